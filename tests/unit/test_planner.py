import pytest

from triton_diffusion.compatibility import CompatibilityKey
from triton_diffusion.config_values import parse_row_caps
from triton_diffusion.engine.planner import PlannedRequest, Row, RowCaps, plan_groups


def k(width=64, height=64, steps=4):
    return CompatibilityKey((("height", height), ("width", width), ("num_inference_steps", steps)))


def plan(requests, max_rows=8, by_resolution=None):
    caps = RowCaps(max_rows, by_resolution or {})
    return plan_groups([PlannedRequest(i, key, rows) for i, (key, rows) in enumerate(requests)], caps.cap_for)


def test_keys_are_never_mixed_and_arrival_order_is_kept():
    calls = plan([(k(), 1), (k(128), 1), (k(), 1), (k(128), 1), (k(), 1)])
    assert [c.request_indices for c in calls] == [[0, 2, 4], [1, 3]]
    for call in calls:
        assert len({call.key}) == 1
    assert calls[1].split_by == "width"


def test_an_incompatible_head_does_not_block_and_is_served_first():
    calls = plan([(k(steps=8), 1), (k(), 1), (k(), 1)])
    assert [c.request_indices for c in calls] == [[0], [1, 2]]


def test_calls_are_capped_in_rows_not_requests():
    calls = plan([(k(), 3), (k(), 3), (k(), 3)], max_rows=4)
    assert [len(c.rows) for c in calls] == [4, 4, 1]
    assert calls[0].rows == [Row(0, 0), Row(0, 1), Row(0, 2), Row(1, 0)]  # request 1 spans two calls
    assert [c.cut_reason for c in calls] == ["row_cap", "row_cap", "drained"]


def test_resolution_caps_apply_only_to_their_resolution_and_win_when_lower():
    calls = plan([(k(512, 512), 1)] * 3 + [(k(), 1)] * 3, max_rows=8, by_resolution={"512x512": 2})
    assert [(c.key.get("width"), len(c.rows), c.cut_reason) for c in calls] == [
        (512, 2, "resolution_cap"),
        (512, 1, "drained"),
        (64, 3, "drained"),
    ]


def test_groups_are_served_oldest_first():
    calls = plan([(k(128), 1), (k(), 1), (k(128), 1), (k(), 1)], max_rows=1)
    assert [c.request_indices[0] for c in calls] == [0, 1, 2, 3]


def test_row_caps_from_config():
    caps = RowCaps.from_config(8, parse_row_caps('{"1024X768": 2}'))
    assert caps.by_resolution == {"1024x768": 2}
    assert caps.cap_for(k(1024, 768)) == (2, "resolution_cap")
    with pytest.raises(ValueError):
        RowCaps.from_config(8, parse_row_caps('{"big": 2}'))


def test_a_video_cap_by_frame_count_wins_over_its_size_cap():
    caps = RowCaps.from_config(8, parse_row_caps('{"832x480": 4, "832x480x81": 1}'))
    assert caps.cap_for_size(480, 832, 81) == (1, "resolution_cap")
    assert caps.cap_for_size(480, 832, 17) == (4, "resolution_cap")  # another frame count: the size's
    assert caps.cap_for_size(480, 832) == (4, "resolution_cap")
    assert caps.cap_for({"height": 480, "width": 832, "num_frames": 81}) == (1, "resolution_cap")
    with pytest.raises(ValueError):
        RowCaps.from_config(8, parse_row_caps('{"832x480x81x2": 1}'))
