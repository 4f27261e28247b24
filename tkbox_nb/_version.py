"""The version of tkbox-nb, in a module that imports nothing.

The recorder writes it into every run and the kernel reports it to Jupyter; both sit below the package's
`__init__`, which imports the box (and so the recorder): reading it from there would close an import circle. Keep it
equal to `version` in pyproject.toml.
"""

__version__ = "0.2.1"
