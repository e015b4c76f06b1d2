"""Explain: the report (``report``, ``render``), the CLI (``cli``, ``inspection``, ``verify``,
``demo``) and the models it knows by name (``examples``, ``hf_config``)."""
