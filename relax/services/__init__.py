"""The asynchronous runtime: roles, the controller that places them, the REST API.

* :mod:`relax.services.context` — a run's shared handles (run record, snapshot, tokenizer, queues).
* :mod:`relax.services.rollout`, :mod:`~relax.services.advantage`, :mod:`~relax.services.actor`
  — the three role loops as plain classes (``step()`` does one unit of work).
* :mod:`relax.services.controller` — ``train(cfg)``: the three topologies.
* :mod:`relax.services.deployments` — the roles as Ray Serve deployments (``async``).
* :mod:`relax.services.api` — the elastic rollout REST API.

Roles never hand data to each other: samples go through the TransferQueue, weights through
the WeightStore. See docs/runtime.md.
"""
