"""The engine core: knows plugins only through tokenmill.interfaces."""
