"""Model-side tensor parallelism: the ranks' collectives (`TPGroup`) and which slice of each weight a rank holds
(`ShardLayout`)."""
