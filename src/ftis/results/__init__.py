"""What the shipped systems' runs and studies turn into: each study's results document and each
system's section of a run's report.md, apart from the algorithms that made the runs.

    grid.py           the F-TIS family's grid studies (RESULTS.md, reco.md, ...; renderer "ftis")
    collab.py         does a node gain by training with a peer (collab.md)
    groups.py         experts in groups of 2, 3 and 4 (groups.md)
    poisoning.py      a poisoning peer against each loss and defence (poisoning.md)
    sampler_dtype.py  learning with a bf16 sampler (bf16-sampler.md)
    fgrpo.py          FGRPO against centralized GRPO and each client alone (fgrpo.md)
    dpo.py            FedDPO, DecDPO and centralized DPO (dpo.md)
    population.py     RandOpt and CoRP against a gradient baseline (population.md)
    swarm.py          a swarm with churn, simulated and on hivemind (swarm.md)
    sections/         the systems' sections of a run's report.md (`ftis report`)

Every table is drawn by the one table layer (`ftis.study.tables`, `ftis.study.pages`); the
systems register these modules by name (`ftis.algos`), so no algorithm imports them.
"""
