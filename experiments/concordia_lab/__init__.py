"""Experiments that are not part of the installed package: the resident GPU executor (``executor``) and the
kernel instrumentation below the framework (``instrument``). See ../README.md for why they live here."""
