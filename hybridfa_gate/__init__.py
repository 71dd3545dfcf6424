"""The GPU restart gate: store a prompt, kill engine and LMCache server, restart both on the same
L2 tier, restore, and judge the restore against what was stored.

Layers, bottom up (each imports only those above it in this list):

- ``models``     the tiny hybrid models (config.json) and the block geometry vLLM derives
- ``prompts``    deterministic prompts and the hit arithmetic of a hybrid connector
- ``l2``         L2 tiers: adapter JSON, a throwaway redis-server, object inventories, the
                 wait for a tier to settle
- ``cases``      a case (one store/restart/restore setting) and the named case sets
- ``lora``, ``forge``  what some cases add: LoRA adapters, a forged L2 object
- ``procs``      processes: LMCache servers, engines (``engine_proc``), logs, cleanup
- ``specs``      what each engine of a case is asked to do
- ``judge``      the criteria (a)-(e), defined in its docstring, and the verdicts
- ``report``     JSON and markdown reports
- ``run``        one case, many cases, the run's environment
- ``options``    the command-line options of the gate (``cli``) and the fault and load runs

The engine itself is ``engine_proc`` (one vLLM engine per process; ``worker`` holds what it
runs inside vLLM's worker, ``load_loop`` the load role's request loop), started by ``procs``; it
imports torch and vLLM, and of this package only what it runs (``worker``, ``load_loop``,
``l2``, ``forge``, ``prompts``, ``models``).

Entry points, from the checkout root (this process imports the standard library only, and
blake3 for a forged case; vLLM and torch only the engines): ``python -m pytest tests/gpu`` (the
installed lmcache), ``python -m hybridfa_gate`` (many cases, one arm), ``python -m
hybridfa_gate.control`` (the control arm's lmcache tree), ``python -m hybridfa_gate.fault`` and
``python -m hybridfa_gate.load`` (the fault and load runs), ``python -m hybridfa_gate.bundle``
(the wheels of a pinned set for a machine without a package index, and ``install-bundle.sh``,
which installs them there). docs/gpu-node.md has the recipes.
"""
