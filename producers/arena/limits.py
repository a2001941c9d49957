"""The arena's time limits, read by ``producers.arena.arena`` and by ``rollout arena``'s flags (a light module: a CLI's
``--help`` imports it without the arena)."""

# a group not fully emitted this long after its claim may be released by any arena: longer than a group takes
ADMISSION_LEASE_S = 600.0
# a rollout's deadline (setup and episode; its cleanup gets as long again): within the lease a group is expected to
# finish in, so a hung tool call, sandbox or verifiers program fails its rollout instead of holding its group
ROLLOUT_TIMEOUT_S = ADMISSION_LEASE_S
# a stopped arena (SIGTERM, Ctrl-C) lets its episodes in flight finish and be emitted for this long, then cuts the
# rest short, so that a command stops within 10 s of SIGTERM whatever its episodes wait on
STOP_GRACE_S = 5.0
