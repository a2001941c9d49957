"""streams.settings: the environment over the defaults, read when asked (tests set the prefix per test)."""

from __future__ import annotations

from streams import settings, topics
from streams.changelog import changelog_topic
from streams.processor_config import ProcessorConfig
from streams.transactions import TransactionalProcessor


def test_defaults(monkeypatch):
    for name in settings._ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    s = settings.ProcessingSettings()
    assert (s.session_timeout_ms, s.txn_timeout_s, s.confirm_s, s.fetch_max_wait_ms) == (10000, 30, 10, 100)
    assert s.stall_s == 30
    assert (s.topic_prefix, s.topic_replication_factor, s.steps_retention_ms) == ("rollout.", 1, -1)


def test_environment_wins_and_empty_means_default(monkeypatch):
    monkeypatch.setenv("ROLLOUT_CONFIRM_S", "8")
    monkeypatch.setenv("ROLLOUT_STALL_S", "120")
    monkeypatch.setenv("ROLLOUT_SESSION_TIMEOUT_MS", "")
    s = settings.ProcessingSettings()
    assert (s.confirm_s, s.stall_s, s.session_timeout_ms) == (8, 120, 10000)
    assert settings.ProcessingSettings(confirm_s=2).confirm_s == 2  # an explicit value wins over the environment


def test_topics_follow_the_environment_at_each_use(monkeypatch):
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", "a.")
    assert topics.STEPS.name == "a.steps" and topics.group_id("batcher") == "a.batcher"
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", "")  # an empty prefix is a prefix, not the default
    assert topics.STEPS.name == "steps"
    monkeypatch.setenv("ROLLOUT_TOPIC_REPLICATION_FACTOR", "3")
    monkeypatch.setenv("ROLLOUT_STEPS_RETENTION_MS", "86400000")
    assert topics.STEPS.replication_factor == 3 and topics.STEPS.topic_configs()["retention.ms"] == "86400000"
    assert topics.ROLLOUTS.topic_configs()["retention.ms"] == "-1"


def test_one_message_limit():
    limit = str(settings.MAX_MESSAGE_BYTES)
    assert topics.STEPS.topic_configs()["max.message.bytes"] == limit
    assert changelog_topic("credit", 12).topic_configs()["max.message.bytes"] == limit


def test_processor_reads_settings_at_construction(monkeypatch):
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", "p.")
    monkeypatch.setenv("ROLLOUT_CONFIRM_S", "7")

    def built(**kw) -> TransactionalProcessor:
        return TransactionalProcessor(ProcessorConfig("credit", ("p.scores",), 12, **kw), lambda p: None, {})

    proc = built(instance="b")
    assert proc.commits.confirm_s == 7 and proc.config.group_id == "p.credit" and proc.txn_id == "p.credit-b"
    # without a name: unique to the process, the same for every processor of the service it rebuilds
    unnamed = [built().txn_id for _ in range(2)]
    assert unnamed[0] == unnamed[1] and unnamed[0].startswith("p.credit-") and unnamed[0] != "p.credit-"
    given = built(settings=settings.ProcessingSettings(txn_timeout_s=5, session_timeout_ms=6000))
    assert given.config.txn_timeout_s == 5 and given.config.session_timeout_ms == 6000


def test_the_cheap_topic_prefix_agrees_with_the_settings(monkeypatch):
    """settings.topic_prefix() (looked up for every record) reads one variable; it must say what current() says."""
    for value in (None, "", "run-1.", "rollout."):
        if value is None:
            monkeypatch.delenv("ROLLOUT_TOPIC_PREFIX", raising=False)
        else:
            monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", value)
        assert settings.topic_prefix() == settings.current().topic_prefix
        with settings.overridden(topic_prefix="demo-1."):
            assert settings.topic_prefix() == settings.current().topic_prefix == "demo-1."


def test_a_service_process_collects_cycles_at_the_configured_pace(monkeypatch) -> None:
    import gc

    from consumers.runner import tune_gc

    before = gc.get_threshold()
    try:
        monkeypatch.setenv("ROLLOUT_GC_THRESHOLD", "12345")
        tune_gc(settings.ProcessingSettings())
        assert gc.get_threshold() == (12345, 20, 100)
        gc.set_threshold(*before)
        monkeypatch.setenv("ROLLOUT_GC_THRESHOLD", "0")  # 0: Python's settings stay
        tune_gc(settings.ProcessingSettings())
        assert gc.get_threshold() == before
        monkeypatch.delenv("ROLLOUT_GC_THRESHOLD")  # the default: Python's settings too
        tune_gc(settings.ProcessingSettings())
        assert gc.get_threshold() == before
    finally:
        gc.set_threshold(*before)
