"""The parameter-server runtime: what every task of a parameter-server cluster runs.

`_transport` carries calls between tasks (`torch.distributed.rpc`, behind a small
interface), `_runtime` is a task's state and the functions the chief and the workers
call on the ps tasks, and `_variables` holds `ParameterServerVariable` and
`ShardedVariable`. `ParameterServerStrategy` (strategies/) builds on it, and
`ClusterCoordinator` (coordinator/) on the strategy.
"""
