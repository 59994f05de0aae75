"""How a run's roles are placed: ``colocated`` (one process), ``async`` (Ray Serve deployments),
``disaggregated`` (one OS process per role). :mod:`relax.services.driver` picks one by ``topology``."""
