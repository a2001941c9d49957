"""rlt-sum-chain: a running total over turns, driven by a scripted user (a verifiers.v1 env package)."""

from rlt_sum_chain.chain import (
    SumChainConfig,
    SumChainData,
    SumChainEnv,
    SumChainTask,
    SumChainTaskset,
    last_int,
)

__all__ = ["SumChainConfig", "SumChainData", "SumChainEnv", "SumChainTask", "SumChainTaskset", "last_int"]
