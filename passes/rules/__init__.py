"""Op rules, one module per op family. Importing this package registers every rule."""

from passes.rules import attention, experts, matmul, norm, pointwise, shape  # noqa: F401

__all__: list[str] = []
