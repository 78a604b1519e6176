"""Durations and tables: what people write is read back, what the product prints reads well."""

import math

import pytest

from jupyter_gpulease.core.text import (
    format_duration,
    format_figure,
    format_gpus,
    format_table,
    format_time_left,
    parse_duration,
    usage_words,
)


@pytest.mark.parametrize(
    "text,seconds",
    [("90", 90), ("90s", 90), ("30m", 1800), ("30 min", 1800), ("2h", 7200), ("1h30m", 5400), ("1 h 12 min", 4320),
     ("1.5h", 5400), ("1d", 86400), ("1h, 30m", 5400), (" 2H ", 7200), (45, 45), (2.5, 2.5)],
)
def test_durations_people_write_are_read_as_seconds(text, seconds):
    assert parse_duration(text) == seconds


def test_a_bare_number_takes_the_unit_the_field_is_in():
    assert parse_duration("2", unit=3600) == 7200
    assert parse_duration(1.5, unit=3600) == 5400
    assert parse_duration("2h", unit=60) == 7200  # an explicit unit wins


def test_a_negative_duration_is_read_only_where_it_makes_sense():
    assert parse_duration("-1h", negative=True) == -3600
    assert parse_duration("-90", negative=True) == -90
    with pytest.raises(ValueError, match="cannot be negative"):
        parse_duration("-1h")


@pytest.mark.parametrize("bad", ["", "h", "1x", "1h30", "soon", "1h-30m", True, math.inf, "nan"])
def test_anything_else_is_refused_with_examples(bad):
    with pytest.raises(ValueError, match=r"not a duration|examples"):
        parse_duration(bad)


@pytest.mark.parametrize(
    "seconds,human,compact",
    [(0, "0 s", "0s"), (45, "45 s", "45s"), (59.4, "59 s", "59s"), (90, "2 min", "2m"), (14 * 60, "14 min", "14m"),
     (3600, "1 h", "1h"), (72 * 60, "1 h 12 min", "1h12m"), (47 * 3600, "47 h", "47h"), (3 * 86400 + 4 * 3600, "3 d 4 h", "3d4h"),
     (-5400, "-1 h 30 min", "-1h30m")],
)
def test_durations_are_printed_in_the_unit_that_matters_at_their_size(seconds, human, compact):
    assert format_duration(seconds) == human
    assert format_duration(seconds, compact=True) == compact


@pytest.mark.parametrize("seconds", [0, 45, 600, 4320, 5400, 86400, 3 * 86400 + 7200])
def test_the_compact_form_reads_back(seconds):
    assert parse_duration(format_duration(seconds, compact=True)) == seconds


@pytest.mark.parametrize(
    "seconds,shown",
    [(-3, "0 s"), (59.9, "59 s"), (119, "1 min"), (2 * 3600 - 10, "1 h 59 min"), (3600, "1 h"), (3 * 86400 - 1, "2 d 23 h")],
)
def test_time_left_never_reads_more_than_is_left(seconds, shown):
    assert format_time_left(seconds) == shown


def test_figures_keep_one_decimal_in_one_unit():
    assert [format_figure(v) for v in (None, 30, 444, 6480, 3 * 86400, math.inf)] == ["-", "30s", "7.4m", "1.8h", "3.0d", "inf"]


def test_tables_line_up_columns_without_trailing_spaces():
    out = format_table([["a", "1"], ["bbb", "22"]], ["NAME", "N"], align="<>")
    assert out.splitlines() == ["NAME   N", "a      1", "bbb   22"]
    ruled = format_table([["x", "1.0"]], ["", "policy"], align="<>", min_width=[4, 9], rule=True)
    assert ruled.splitlines() == ["         policy", "-" * 15, "x           1.0"]


def test_gpu_counts_and_the_callers_use_of_the_pool_read_as_people_write_them():
    assert [format_gpus(v) for v in (None, 2.0, 0.5, 299.936, 1250.0)] == ["-", "2", "0.5", "299.9", "1,250"]
    assert usage_words({"gpus_held": 1}) == "you hold 1 GPU"
    assert usage_words({"gpus_held": 0.5, "max_gpus": 2, "gpu_hours_left": 299.936, "gpu_hours": 300, "period_s": 604800}) == \
        "you hold 0.5 GPUs of your 2; 299.9 of 300 GPU-hours left this 7 d"
