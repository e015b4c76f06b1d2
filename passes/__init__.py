"""fxtp's graph passes: dependency analysis (``propagate`` with op ``rules``), planning
(``plan``), and the rewrite (``rewrite``). See ``passes/README.md`` for the pipeline and the
``node.meta`` keys each pass reads and writes."""

__all__: list[str] = []
