"""Explain: the report (``report``, its figures in ``counts``, ``alternatives``, ``recompute``,
``repeats``) and its rendering (``render``). The CLI that prints them is ``fxtp.cli``."""
