"""The one thing pyproject.toml cannot say in a stable form: the C extension.

``executor/_ringfast.c`` holds the executor ring's host fast paths, ``core/_slotlog.c`` graph decode's token-epoch
writer. Both are optional: without a C compiler and the
Python headers the install still succeeds, and the pure-Python twins run (``concordia
doctor`` says which is in use).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("concordia_ft.executor._ringfast", ["src/concordia_ft/executor/_ringfast.c"], optional=True,
              extra_compile_args=["-O2"]),
    # the token-epoch writer of graph decode (ring slots -> committed epochs, GIL released); optional too:
    # core/slotlog.py falls back to the Python writer in integrations/graph_decode.py
    Extension("concordia_ft.core._slotlog", ["src/concordia_ft/core/_slotlog.c"], optional=True,
              depends=["src/concordia_ft/core/_crc32c.h"], extra_compile_args=["-O2", "-pthread"]),
    # the streamed restore's chunk loop (copy pthreads + the hand-over, GIL released); optional:
    # core/streamed.py runs its Python loop without it
    Extension("concordia_ft.core._streamloop", ["src/concordia_ft/core/_streamloop.c"], optional=True,
              depends=["src/concordia_ft/core/_crc32c.h"], extra_compile_args=["-O2", "-pthread"], libraries=["dl"]),
])
