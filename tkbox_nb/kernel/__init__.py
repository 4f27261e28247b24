"""`python -m tkbox_nb.kernel`: the entry point every installed kernel.json names, and nothing else.

It stays at this path so kernelspecs installed before the package's move to one folder per layer keep starting;
`__main__.py` starts the notebook's box early, then the kernel itself (`tkbox_nb/jupyter/kernel/app.py`, whose
kernelspec installer is `tkbox_nb/jupyter/kernel/install.py`).
"""
