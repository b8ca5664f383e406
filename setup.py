"""The one thing pyproject.toml cannot say in a stable form: the C extension.

``executor/_ringfast.c`` holds the executor ring's host fast paths. It is optional: without a C compiler and the
Python headers the install still succeeds, and ``executor/ring.py`` runs its pure-Python twin (``concordia
doctor`` says which is in use).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("concordia_ft.executor._ringfast", ["src/concordia_ft/executor/_ringfast.c"], optional=True,
              extra_compile_args=["-O2"]),
])
