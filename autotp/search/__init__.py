"""The layout search: which tp × dp × pp (FSDP, micro-batches) to run a model with on given hardware.

What a model costs, read from its captured graph and its plans (``model_costs.py``), hardware profiles and the measured
profiler that writes them (``hardware.py``, ``profile.py``), the cost of one candidate layout
(:class:`~autotp.search.cost.Candidate`, ``cost.py``), which of its terms rest on assumptions (``assumed.py``),
and the enumeration and ranking (``auto.py``). It reads plans; nothing below it reads it.
"""
