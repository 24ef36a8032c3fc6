"""Serving from an engine-core process: the engine steps in a process of its own, the HTTP
server streams in this one (``tokenmill serve --engine-process``), or in several
(``--api-server-count``)."""
