"""The Tracekit Box Jupyter kernel (app.py) and its kernelspec installer (install.py)."""
