"""Stands in for the package ``rfc3987-syntax`` inside the local Ray's processes, and refuses to import.

Every Ray process imports ``jsonschema`` (``ray/_private/runtime_env/plugin_schema_manager.py``), and
``jsonschema/_format.py`` imports ``rfc3987_syntax`` when it is installed (Jupyter's ``jsonschema[format-nongpl]``
installs it) to check the ``iri`` formats. That import builds an Earley parser from a grammar
(``Lark(..., parser="earley")`` in ``rfc3987_syntax/syntax_helpers.py``): about 2 s of CPU, three quarters of
``import ray``, paid again by each of Ray's Python processes (dashboard agent, runtime-env agent, monitor,
log monitor, every worker). ``jsonschema`` guards that import with ``contextlib.suppress(ImportError)``, so
failing here only leaves out the ``iri`` format checks, which nothing in Ray asks for (no ``iri`` format
appears in the installed ``ray`` package).
"""

raise ImportError("rfc3987_syntax is left out of the local Ray's processes (ddpkit.engines.ray_launch)")
