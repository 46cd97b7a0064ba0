"""The suite's machinery, registered by tests/conftest.py (pytest_plugins): the lanes and their scheduling (lanes), the
memory lock (memory), the engines and rank processes tests share (shared_engines), the skips allowed (skips) and the
modules' scratch directories (scratch)."""
