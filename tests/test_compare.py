"""``python -m benchmarks compare``'s figures by name: nested keys, a number indexing a list."""

from benchmarks.compare import _get


def test_a_dotted_key_reaches_into_objects_and_lists():
    out = {"shapes": [{"over_floor": 3.0, "seconds": {"step": [2.4, 2.5]}}], "wall_s": 9.5}
    assert _get(out, "wall_s") == 9.5
    assert _get(out, "shapes.0.over_floor") == 3.0
    assert _get(out, "shapes.0.seconds.step") == [2.4, 2.5]
    assert _get(out, "shapes.1.over_floor") is None and _get(out, "shapes.x") is None
    assert _get(out, "missing.0") is None
