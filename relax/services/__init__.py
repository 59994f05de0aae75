"""The runtime of a run: its roles, how they are placed, and what a user sees of them.

* :mod:`relax.services.driver`: ``train(cfg)`` runs (or resumes) a run in its topology and
  returns a :class:`~relax.services.driver.TrainSummary`.
* :mod:`relax.services.run_context`: a run's shared handles (snapshot, tokenizer, queues);
  :mod:`relax.services.run_record`: the run's record; :mod:`relax.services.queue_contract`: the
  queue's topics, consumer groups and fields.
* :mod:`relax.services.roles`: rollout, advantage, actor, critic, reference, reward and teacher, each a
  plain class whose ``step()`` does one unit of work; ``roles.factory`` names and builds them.
* :mod:`relax.services.topologies`: ``colocated`` (one process), ``asynchronous`` (Ray Serve
  deployments), ``disaggregated`` (one OS process per role), and ``runner`` (one role's loop).
* :mod:`relax.services.launchers`: engine servers as local processes or Ray actors.
* :mod:`relax.services.rollout_engines`: the engines of a rollout's config, in one call.
* :mod:`relax.services.api`: the HTTP fronts of a run: the elastic rollout REST API, the server
  that hosts it, and the session gateway for external agents.
* :mod:`relax.services.report`: metrics logs, TensorBoard events and PNG curves.
* :mod:`relax.services.replay`: retrain a run's recorded steps from a checkpoint and compare.

Roles never hand data to each other: samples go through the TransferQueue, weights through
the WeightStore. See docs/runtime.md.
"""
