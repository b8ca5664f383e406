"""The one thing pyproject.toml cannot say in a stable form: the C extensions.

``core/_slotlog.c`` holds the token-epoch writer (and the multi-buffer CRC32C), ``core/_ntcopy.c`` the
streamed restore's copies with streaming stores. Both are optional: without a C compiler and the Python headers the install still
succeeds, and the pure-Python twins run (``concordia doctor`` says which is in use).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    # the token-epoch writer of graph decode (ring slots -> committed epochs, GIL released); optional too:
    # core/slotlog.py falls back to the Python writer in integrations/graph_decode.py
    Extension("concordia_ft.core._slotlog", ["src/concordia_ft/core/_slotlog.c"], optional=True,
              depends=["src/concordia_ft/core/_crc32c.h", "src/concordia_ft/core/_crc32c_gf2.h"], extra_compile_args=["-O2", "-pthread"]),
    # the streamed restore's fills with streaming stores (RecoveryOptions.nontemporal); optional: memcpy without it
    Extension("concordia_ft.core._ntcopy", ["src/concordia_ft/core/_ntcopy.c"], optional=True,
              extra_compile_args=["-O2"]),
])
