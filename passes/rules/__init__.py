"""Op rules, one module per op family. Importing this package registers every rule."""

from passes.rules import attention, experts, index_copy, indexing, matmul, norm, pointwise, random, repeat, shape  # noqa: F401

__all__: list[str] = []
