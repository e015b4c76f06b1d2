"""Mixture-of-experts passes: the deferred reduction that combines the experts' partial sums
once (``reductions``), the routed-experts blocks of a graph (``blocks``) and expert parallelism
(``parallel``)."""
