"""The trace readers on small files written here and on the two published traces in
bench/traces: what they read, and how every kind of bad file is named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from headroom.operator.simulate.profile import ideal_hit_ratio
from headroom.operator.simulate.trace import TraceError, read_trace, scaled

TRACES = Path(__file__).resolve().parents[1] / "bench" / "traces"
AZURE = TRACES / "azure-llm-2023-conv.csv"
MOONCAKE = TRACES / "mooncake-synthetic.jsonl"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def mooncake_line(ts: int, prompt: int, output: int, ids: list[int]) -> str:
    return json.dumps(
        {"timestamp": ts, "input_length": prompt, "output_length": output, "hash_ids": ids}
    )


def test_the_azure_reader_takes_seven_fractional_digits_and_times_from_the_first_request(
    tmp_path: Path,
) -> None:
    path = write(
        tmp_path,
        "az.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:16:46.6805900,12,1",  # no trailing newline, as Azure's file
    )
    t = read_trace(path)
    assert t.name == "az" and len(t) == 3
    assert t.arrival.tolist() == pytest.approx([0.0, 4.314579, 60.0], abs=1e-6)
    assert t.prompt.tolist() == [374, 396, 12] and t.output.tolist() == [44, 109, 1]
    assert t.prefix_blocks is None


def test_the_mooncake_reader_takes_milliseconds_and_keeps_the_block_ids(tmp_path: Path) -> None:
    lines = [
        mooncake_line(0, 1000, 5, [0, 1]),
        mooncake_line(2500, 512, 7, [0]),
        mooncake_line(1000, 1025, 9, [0, 1, 2]),
    ]
    t = read_trace(write(tmp_path, "mc.jsonl", "\n".join(lines) + "\n"))
    assert t.arrival.tolist() == [0.0, 1.0, 2.5]  # sorted by arrival
    assert t.prompt.tolist() == [1000, 1025, 512]
    assert t.prefix_blocks == ((0, 1), (0, 1, 2), (0,))
    assert t.prefix_block_tokens == 512


def test_the_generic_csv_ignores_extra_columns_and_any_time_origin(tmp_path: Path) -> None:
    text = "arrival_s,prompt_tokens,output_tokens,tenant\n100.5,10,2,a\n100,20,3,b\n\n"
    t = read_trace(write(tmp_path, "g.csv", text))
    assert t.arrival.tolist() == [0.0, 0.5] and t.prompt.tolist() == [20, 10]


def test_the_generic_jsonl_reads_its_own_prefix_block_size(tmp_path: Path) -> None:
    rows = [
        {"arrival_s": 0, "prompt_tokens": 64, "output_tokens": 1, "prefix_block_ids": [7, 8],
         "prefix_block_tokens": 32},
        {"arrival_s": 1.5, "prompt_tokens": 40, "output_tokens": 1, "prefix_block_ids": [7, 9]},
    ]  # fmt: skip
    t = read_trace(write(tmp_path, "g.jsonl", "\n".join(json.dumps(r) for r in rows)))
    assert t.prefix_block_tokens == 32 and t.prefix_blocks == ((7, 8), (7, 9))
    # Block 7 (32 tokens) repeats: 32 of 64 + 40 prompt tokens.
    assert ideal_hit_ratio(t) == pytest.approx(32 / 104)


def test_the_generic_jsonl_without_block_ids_has_no_prefix_identity(tmp_path: Path) -> None:
    row = {"arrival_s": 0, "prompt_tokens": 64, "output_tokens": 1}
    t = read_trace(write(tmp_path, "g.jsonl", json.dumps(row)))
    assert t.prefix_blocks is None and ideal_hit_ratio(t) is None


def test_a_spreadsheet_byte_order_mark_before_the_header_is_read(tmp_path: Path) -> None:
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbfarrival_s,prompt_tokens,output_tokens\r\n0,5,5\r\n1,6,6\r\n")
    assert read_trace(path).prompt.tolist() == [5, 6]


def test_a_forced_format_reads_the_file_as_that_format(tmp_path: Path) -> None:
    path = write(tmp_path, "x.txt", "arrival_s,prompt_tokens,output_tokens\n0,5,5\n")
    assert len(read_trace(path, "csv")) == 1
    with pytest.raises(TraceError, match=r"^x\.txt:1: expected the header TIMESTAMP"):
        read_trace(path, "azure")


def test_the_published_azure_trace_has_its_documented_requests_and_lengths() -> None:
    t = read_trace(AZURE)
    assert len(t) == 19_366
    assert 3400 < t.duration < 3600  # one hour
    assert np.percentile(t.prompt, [50, 95, 99]).round().tolist() == [1020, 4083, 4142]
    assert np.percentile(t.output, [50, 95, 99]).round().tolist() == [129, 451, 601]
    assert np.all(np.diff(t.arrival) >= 0)


def test_the_published_mooncake_trace_has_its_documented_requests_and_prefix_ceiling() -> None:
    t = read_trace(MOONCAKE)
    assert len(t) == 3_993
    assert t.duration == pytest.approx(1022, abs=1)
    assert np.percentile(t.prompt, 50) == 11_587
    hit = ideal_hit_ratio(t)
    assert hit is not None and 0.64 <= hit <= 0.66


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("wrong-header.csv", "time,prompt,output\n0,1,1\n",
         r"^wrong-header\.csv:1: not a trace this reads"),
        ("tokens.csv", "arrival_s,prompt_tokens,output_tokens\n0,5,5\n1,five,5\n",
         r"^tokens\.csv:3: prompt_tokens must be an integer, got 'five'"),
        ("zero.csv", "arrival_s,prompt_tokens,output_tokens\n0,5,5\n1,5,0\n",
         r"^zero\.csv:3: output_tokens must be at least 1, got 0"),
        ("time.csv", "arrival_s,prompt_tokens,output_tokens\nsoon,5,5\n",
         r"^time\.csv:2: arrival time must be a number, got 'soon'"),
        ("short.csv", "arrival_s,prompt_tokens,output_tokens\n0,5\n",
         r"^short\.csv:2: expected 3 columns, got 2"),
        ("stamp.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,3,4\n"
         "16/11/2023 18:15,3,4\n", r"^stamp\.csv:3: TIMESTAMP must be YYYY-MM-DD HH:MM:SS"),
        ("ids.jsonl", mooncake_line(0, 600, 1, [1, 2]) + "\n" + mooncake_line(5, 600, 1, [1, 2, 3]),
         r"^ids\.jsonl:2: 3 hash_ids for 600 tokens \(expected ceil\(600 / 512\)\)"),
        ("broken.jsonl", mooncake_line(0, 600, 1, [1, 2]) + "\n\n{\"timestamp\": 1,",
         r"^broken\.jsonl:3: not JSON"),
        ("list.jsonl", mooncake_line(0, 600, 1, [1, 2]) + "\n[1, 2]\n",
         r"^list\.jsonl:2: expected a JSON object, got list"),
        ("missing.jsonl", '{"timestamp": 0, "input_length": 5}\n',
         r"^missing\.jsonl:1: missing 'output_length'"),
        ("nan.jsonl", '{"arrival_s": NaN, "prompt_tokens": 5, "output_tokens": 5}\n',
         r"^nan\.jsonl:1: arrival time must be finite"),
        ("header-only.csv", "arrival_s,prompt_tokens,output_tokens\n",
         r"^header-only\.csv: no requests"),
        ("quote.csv", 'arrival_s,prompt_tokens,output_tokens,note\n0,5,5,"open\n1,5,5,x\n',
         r"^quote\.csv:3: not CSV: unexpected end of data"),
        ("huge.csv", "arrival_s,prompt_tokens,output_tokens\n0,5,5\n1,99999999999999999999,5\n",
         r"^huge\.csv:3: prompt_tokens must be at most 10,000,000"),
        ("long.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,3,4\n"
         "2023-11-16 18:15:47.1,9000000,1000001\n",
         r"^long\.csv:3: prompt \+ output tokens must be at most 10,000,000, got 9,000,000 \+"),
        ("far.jsonl", '{"arrival_s": 1e400, "prompt_tokens": 5, "output_tokens": 5}\n'
         '{"arrival_s": 1' + "0" * 400 + ', "prompt_tokens": 5, "output_tokens": 5}\n',
         r"^far\.jsonl:1: arrival time must be finite"),
        ("epoch.csv", "arrival_s,prompt_tokens,output_tokens\n1700000000,5,5\n0,5,5\n",
         r"^epoch\.csv: arrivals span 19,676 days .* is one timestamp from another clock"),
        ("empty.csv", "", r"^empty\.csv: empty file"),
        ("big-id.jsonl",
         mooncake_line(0, 600, 1, [1, 2]) + "\n" + mooncake_line(5, 600, 1, [1, 2**63]),
         r"^big-id\.jsonl:2: hash_ids must be 64-bit integers .* got 9223372036854775808"),
        ("small-id.jsonl", '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 5, '
         '"prefix_block_ids": [' + "9" * 30 + "]}\n",
         r"^small-id\.jsonl:1: prefix_block_ids must be 64-bit integers .* got 9{24}\.\.\."),
        ("true.jsonl", '{"timestamp": true, "input_length": 5, "output_length": 5}\n',
         r"^true\.jsonl:1: arrival time must be a number, got True"),
        ("digits.jsonl", '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 5}\n'
         '{"arrival_s": 1' + "0" * 5000 + ', "prompt_tokens": 5, "output_tokens": 5}\n',
         r"^digits\.jsonl:2: not JSON this reads: Exceeds the limit \(4300 digits\)"),
        ("deep.jsonl", '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 5}\n'
         + '{"a": ' * 100_000 + "1" + "}" * 100_000 + "\n",
         r"^deep\.jsonl:2: not JSON this reads: nested too deeply"),
        ("deep-first.jsonl", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
         r"^deep-first\.jsonl:1: not JSON this reads: nested too deeply"),
        ("exponent.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,3,4\n"
         "2023-11-16 18:00:00.5e3,3,4\n",
         r"^exponent\.csv:3: TIMESTAMP must be YYYY-MM-DD HH:MM:SS"),
        ("wide.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.\uff15,3,4\n",
         r"^wide\.csv:2: TIMESTAMP must be YYYY-MM-DD HH:MM:SS"),
        ("day.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16,3,4\n2023-11-17,3,4\n",
         r"^day\.csv:2: TIMESTAMP must be YYYY-MM-DD HH:MM:SS"),
        ("zone.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46+25:00,3,4\n",
         r"^zone\.csv:2: TIMESTAMP must be YYYY-MM-DD HH:MM:SS"),
    ],
)  # fmt: skip
def test_a_bad_file_names_the_file_the_line_and_the_reason(
    tmp_path: Path, name: str, text: str, expected: str
) -> None:
    with pytest.raises(TraceError, match=expected):
        read_trace(write(tmp_path, name, text))


def test_a_json_integer_beyond_a_float_is_a_trace_error(tmp_path: Path) -> None:
    text = '{"arrival_s": 1' + "0" * 400 + ', "prompt_tokens": 5, "output_tokens": 5}\n'
    # Its first 24 digits are shown, not all 401.
    with pytest.raises(
        TraceError, match=r"^far\.jsonl:1: arrival time must be finite, got 10{23}\.\.\.$"
    ):
        read_trace(write(tmp_path, "far.jsonl", text))


def test_an_extra_column_of_whole_prompts_is_ignored_however_long(tmp_path: Path) -> None:
    prompt = "x" * 300_000  # over the csv module's default field limit of 128 KiB
    text = f'arrival_s,prompt_tokens,output_tokens,prompt\n0,5,5,{prompt}\n2,6,7,"{prompt}"\n'
    t = read_trace(write(tmp_path, "prompts.csv", text))
    assert t.prompt.tolist() == [5, 6] and t.arrival.tolist() == [0.0, 2.0]


def test_a_rate_that_leaves_no_request_is_a_trace_error() -> None:
    t = read_trace(AZURE)
    with pytest.raises(TraceError, match=r"a rate of 1e-06 leaves none of its 19,366 requests"):
        scaled(t, 1e-6, seed=1, jitter_seconds=5.0)


def test_a_missing_file_is_a_trace_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"nowhere\.csv: cannot read"):
        read_trace(tmp_path / "nowhere.csv")


def test_a_binary_file_is_a_trace_error_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01")
    with pytest.raises(TraceError, match=r"weights\.bin: cannot read"):
        read_trace(path)


def test_a_reader_reports_its_progress_in_lines(tmp_path: Path) -> None:
    rows = "".join(f"{i * 0.01:.2f},10,10\n" for i in range(120_000))
    path = write(tmp_path, "big.csv", "arrival_s,prompt_tokens,output_tokens\n" + rows)
    seen: list[tuple[int, int]] = []
    t = read_trace(path, progress=lambda done, total: seen.append((done, total)))
    assert len(t) == 120_000
    assert [d for d, _ in seen] == [50_000, 100_000]
    assert all(total >= 120_001 for _, total in seen)


def test_scaled_keeps_the_count_at_factor_one_and_doubles_it_at_two() -> None:
    t = read_trace(AZURE)
    once = scaled(t, 1.0, seed=1, jitter_seconds=5.0)
    assert len(once) == len(t)
    assert sorted(once.prompt.tolist()) == sorted(t.prompt.tolist())  # the same requests
    assert np.all(np.diff(once.arrival) >= 0) and once.arrival[0] == 0.0
    assert len(scaled(t, 2.0, seed=1, jitter_seconds=5.0)) == 2 * len(t)
    half = len(scaled(t, 1.5, seed=1, jitter_seconds=5.0))
    assert 1.45 * len(t) < half < 1.55 * len(t)


def test_scaled_seeds_are_different_realizations_of_the_same_traffic() -> None:
    t = read_trace(MOONCAKE)
    a, b = scaled(t, 1.0, 1, 5.0), scaled(t, 1.0, 2, 5.0)
    assert not np.array_equal(a.arrival, b.arrival)
    assert a.prefix_blocks is not None and ideal_hit_ratio(a) == pytest.approx(
        ideal_hit_ratio(t), abs=0.02
    )
    again = scaled(t, 1.0, 1, 5.0)
    assert np.array_equal(a.arrival, again.arrival)


def test_json_lines_end_only_at_a_newline(tmp_path: Path) -> None:
    # JSON strings may hold U+2028, U+2029 and U+0085 raw (json.dumps(ensure_ascii=False)).
    lines = [
        json.dumps({"arrival_s": i, "prompt_tokens": 10, "output_tokens": 5,
                    "prompt": f"hello{sep}world"}, ensure_ascii=False)
        for i, sep in enumerate(("\u2028", "\u2029", "\u0085"))
    ]  # fmt: skip
    t = read_trace(write(tmp_path, "raw.jsonl", "\r\n".join(lines) + "\r\n"))
    assert t.arrival.tolist() == [0.0, 1.0, 2.0]


def test_generic_prefix_block_ids_past_the_prompt_are_refused(tmp_path: Path) -> None:
    text = "".join(
        json.dumps({"arrival_s": t, "prompt_tokens": n, "output_tokens": 10,
                    "prefix_block_ids": ids}) + "\n"
        for t, n, ids in ((0, 1500, [1, 2, 3]), (1, 100, [7, 2, 3]))
    )  # fmt: skip
    with pytest.raises(TraceError, match=r"^ids\.jsonl:2: 3 prefix_block_ids for 100 tokens"):
        read_trace(write(tmp_path, "ids.jsonl", text))


def test_blank_lines_in_a_csv_are_skipped_as_in_json_lines(tmp_path: Path) -> None:
    text = "\n  \narrival_s,prompt_tokens,output_tokens\n0,5,5\n \n1,6,7\n   \n"
    t = read_trace(write(tmp_path, "blank.csv", text))
    assert t.prompt.tolist() == [5, 6]


def test_an_azure_timestamp_with_a_zone_is_converted_to_utc_with_or_without_a_fraction(
    tmp_path: Path,
) -> None:
    # 18:00 UTC, then 19:00:30 at +01:00 (18:00:30 UTC), 18:00:40.5 UTC, 17:00:50.25 at -01:00.
    text = (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:00:00,1,1\n2023-11-16 19:00:30+01:00,2,1\n"
        "2023-11-16T18:00:40.5Z,3,1\n2023-11-16 17:00:50.2500000-01:00,4,1\n"
    )
    t = read_trace(write(tmp_path, "zones.csv", text))
    assert t.arrival.tolist() == pytest.approx([0.0, 30.0, 40.5, 50.25])
    assert t.prompt.tolist() == [1, 2, 3, 4]


def test_the_ideal_hit_ratio_counts_prompt_tokens_without_block_ids(tmp_path: Path) -> None:
    rows = [
        {"arrival_s": 0, "prompt_tokens": 64, "output_tokens": 1, "prefix_block_ids": [7, 8],
         "prefix_block_tokens": 32},
        {"arrival_s": 1, "prompt_tokens": 64, "output_tokens": 1, "prefix_block_ids": [7, 8]},
        {"arrival_s": 2, "prompt_tokens": 128, "output_tokens": 1},  # no ids: no hit, still read
    ]  # fmt: skip
    t = read_trace(write(tmp_path, "part.jsonl", "\n".join(json.dumps(r) for r in rows)))
    assert ideal_hit_ratio(t) == pytest.approx(64 / (64 + 64 + 128))


def test_a_quoted_csv_header_is_detected_as_the_csv_reader_reads_it(tmp_path: Path) -> None:
    text = '"arrival_s","prompt_tokens","output_tokens"\n0,10,10\n1,11,10\n'
    assert read_trace(write(tmp_path, "quoted.csv", text)).prompt.tolist() == [10, 11]


def test_text_that_is_not_utf8_is_named_by_its_line(tmp_path: Path) -> None:
    path = tmp_path / "latin.csv"
    path.write_bytes(b"arrival_s,prompt_tokens,output_tokens\n0,10,10\n\xff\xfe,1,1\n")
    with pytest.raises(TraceError, match=r"latin\.csv: cannot read: line 3 is not UTF-8"):
        read_trace(path)


def test_a_gzipped_trace_is_told_to_be_decompressed_first(tmp_path: Path) -> None:
    import gzip

    path = tmp_path / "t.csv.gz"
    path.write_bytes(gzip.compress(b"arrival_s,prompt_tokens,output_tokens\n0,10,10\n"))
    with pytest.raises(TraceError, match=r"t\.csv\.gz: cannot read: gzip-compressed .*decompress"):
        read_trace(path)


def test_generic_prefix_block_tokens_must_be_one_size_for_the_whole_trace(tmp_path: Path) -> None:
    def line(t: int, ids: list[int], size: int | None) -> str:
        row: dict[str, object] = {"arrival_s": t, "prompt_tokens": 1024, "output_tokens": 1,
                                  "prefix_block_ids": ids}  # fmt: skip
        if size is not None:
            row["prefix_block_tokens"] = size
        return json.dumps(row) + "\n"

    same = line(0, [1, 2], 512) + line(1, [1, 2], None) + line(2, [1, 3], 512)
    assert read_trace(write(tmp_path, "same.jsonl", same)).prefix_block_tokens == 512
    mixed = line(0, [1, 2], 512) + "\n" + line(1, [1, 2], None) + line(2, [7], 1024)
    with pytest.raises(TraceError) as info:
        read_trace(write(tmp_path, "mixed.jsonl", mixed))
    assert str(info.value) == (
        "mixed.jsonl:4: prefix_block_tokens is 1024, but line 1 set it to 512: a trace has one "
        "block size"
    )


@pytest.mark.parametrize("end", ["\r", "\r\n"])
def test_classic_mac_and_windows_line_endings_are_read_with_their_lines(
    tmp_path: Path, end: str
) -> None:
    rows = ["arrival_s,prompt_tokens,output_tokens", "0,10,5", "1,20,5"]
    t = read_trace(write(tmp_path, "mac.csv", end.join(rows) + end))
    assert t.prompt.tolist() == [10, 20]
    bad = write(tmp_path, "bad.csv", end.join([*rows, "2,0,5"]) + end)
    with pytest.raises(TraceError, match=r"^bad\.csv:4: prompt_tokens must be at least 1"):
        read_trace(bad)
    jsonl = end.join(json.dumps({"arrival_s": i, "prompt_tokens": 9, "output_tokens": 1})
                     for i in range(3)) + end + "nope" + end  # fmt: skip
    with pytest.raises(TraceError, match=r"^bad\.jsonl:4: not JSON"):
        read_trace(write(tmp_path, "bad.jsonl", jsonl))
    latin = (end.join(rows) + end + "2,\xe9,5" + end).encode("latin-1")
    (tmp_path / "latin.csv").write_bytes(latin)
    with pytest.raises(TraceError, match=r"line 4 is not UTF-8"):
        read_trace(tmp_path / "latin.csv")


def test_a_trace_may_span_31_days_and_no_more(tmp_path: Path) -> None:
    month = 31 * 86_400
    ok = write(
        tmp_path, "month.csv", f"arrival_s,prompt_tokens,output_tokens\n0,5,5\n{month},5,5\n"
    )
    assert read_trace(ok).duration == month
    over = write(
        tmp_path, "over.csv", f"arrival_s,prompt_tokens,output_tokens\n0,5,5\n{month + 1},5,5\n"
    )
    with pytest.raises(TraceError) as info:
        read_trace(over)
    assert str(info.value) == (
        "over.csv: arrivals span 31.0 days (0 to 2.6784e+06 s), more than the 31 a trace may: "
        "is one timestamp from another clock?"
    )
    far = write(tmp_path, "far.csv", "arrival_s,prompt_tokens,output_tokens\n0,5,5\n1e300,5,5\n")
    with pytest.raises(
        TraceError, match=r"^far\.csv: arrivals span 1\.2e\+295 days \(0 to 1e\+300 s\)"
    ):
        read_trace(far)


def test_a_request_of_exactly_10_million_tokens_is_read_and_one_more_is_refused(
    tmp_path: Path,
) -> None:
    ok = write(tmp_path, "ok.csv", "arrival_s,prompt_tokens,output_tokens\n0,9999999,1\n")
    assert read_trace(ok).prompt.tolist() == [9_999_999]
    # 10,000,000 prompt tokens is a count the CRD takes; with its output the context is not.
    sum_over = write(tmp_path, "sum.csv", "arrival_s,prompt_tokens,output_tokens\n0,10000000,1\n")
    with pytest.raises(TraceError, match=r"^sum\.csv:2: prompt \+ output tokens must be at most"):
        read_trace(sum_over)
    row = {"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 5, "prefix_block_tokens": 10**7}
    assert read_trace(write(tmp_path, "b.jsonl", json.dumps(row))).prefix_block_tokens == 10**7


def test_block_ids_take_the_whole_signed_64_bit_range(tmp_path: Path) -> None:
    lo, hi = -(2**63), 2**63 - 1
    t = read_trace(write(tmp_path, "ids.jsonl", mooncake_line(0, 1024, 1, [lo, hi]) + "\n"))
    assert t.prefix_blocks == ((lo, hi),)
    with pytest.raises(TraceError, match=r"^low\.jsonl:1: hash_ids must be 64-bit .* got -9223"):
        read_trace(write(tmp_path, "low.jsonl", mooncake_line(0, 1024, 1, [lo - 1, 0]) + "\n"))
    # The message names the id out of range, not the edge of the range before it.
    for ids, bad in (([lo, hi + 1], hi + 1), ([hi, lo - 1], lo - 1)):
        with pytest.raises(TraceError, match=rf"got {bad}$"):
            read_trace(write(tmp_path, "edge.jsonl", mooncake_line(0, 1024, 1, ids) + "\n"))
    # An id of 24 characters is shown whole; one of 25 is cut to its first 24.
    for n, shown in ((23, "-" + "9" * 23), (24, "-" + "9" * 23 + "...")):
        line = mooncake_line(0, 600, 1, [1, -int("9" * n)])
        with pytest.raises(TraceError) as info:
            read_trace(write(tmp_path, "x.jsonl", line))
        assert str(info.value).endswith(f"in size), got {shown}")


@pytest.mark.parametrize("ids", ["[true, 2]", "5", '"1,2"', '{"1": 2}'])
def test_block_ids_must_be_a_list_of_integers(tmp_path: Path, ids: str) -> None:
    text = f'{{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": {ids}}}\n'
    with pytest.raises(TraceError, match=r"^b\.jsonl:1: hash_ids must be a list of integers$"):
        read_trace(write(tmp_path, "b.jsonl", text))


def test_text_that_is_not_utf8_after_a_blank_first_line_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "blank.csv"
    path.write_bytes(b"\narrival_s,prompt_tokens,output_tokens\n0,10,10\n\xff,1,1\n")
    with pytest.raises(TraceError, match=r"blank\.csv: cannot read: line 4 is not UTF-8"):
        read_trace(path)


def test_a_json_lines_reader_reports_its_progress_in_lines(tmp_path: Path) -> None:
    row = '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 5}\n'
    path = write(tmp_path, "big.jsonl", row * 100_000)
    seen: list[tuple[int, int]] = []
    t = read_trace(path, progress=lambda done, total: seen.append((done, total)))
    assert len(t) == 100_000 and seen == [(50_000, 100_001), (100_000, 100_001)]


def test_scaled_rejects_a_rate_that_is_not_positive() -> None:
    t = read_trace(MOONCAKE)
    for factor in (0.0, -1.0):
        with pytest.raises(ValueError, match=r"^the rate factor must be positive"):
            scaled(t, factor, seed=1, jitter_seconds=5.0)


def test_scaled_at_factor_one_without_jitter_is_the_trace_itself() -> None:
    t = read_trace(MOONCAKE)
    once = scaled(t, 1.0, seed=1, jitter_seconds=0.0)
    assert np.array_equal(once.arrival, t.arrival) and np.array_equal(once.prompt, t.prompt)
    assert once.prefix_blocks == t.prefix_blocks


def test_an_azure_trace_with_an_extra_column_is_detected_and_read(tmp_path: Path) -> None:
    text = (
        "TIMESTAMP,ContextTokens,GeneratedTokens,Region\n"
        "2023-11-16 18:15:46.5,374,44,eu\n2023-11-16 18:15:47,396,109,us\n"
    )
    t = read_trace(write(tmp_path, "az.csv", text))
    assert t.arrival.tolist() == [0.0, 0.5] and t.prompt.tolist() == [374, 396]


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be"])
def test_a_utf16_trace_is_told_to_be_saved_as_utf8(tmp_path: Path, encoding: str) -> None:
    path = tmp_path / "wide.csv"
    bom = "\ufeff".encode(encoding)
    path.write_bytes(bom + "arrival_s,prompt_tokens,output_tokens\n0,10,10\n".encode(encoding))
    with pytest.raises(TraceError, match=r"wide\.csv: cannot read: UTF-16 \(save it as UTF-8\)"):
        read_trace(path)


@pytest.mark.parametrize(
    ("name", "text", "line"),
    [
        ("lead.jsonl", '\n\n{"arrival_s": 0,\n', 3),
        ("lead.csv", "\n\n\ntime,prompt,output\n0,1,1\n", 4),
        ("spaced.jsonl", '  \n{"arrival_s": 0,\n', 2),
    ],
)
def test_a_bad_first_line_after_blank_ones_is_named_by_its_line_in_the_file(
    tmp_path: Path, name: str, text: str, line: int
) -> None:
    """Format detection names the line an editor shows, as the readers do after it."""
    with pytest.raises(TraceError, match=f"^{re.escape(name)}:{line}: "):
        read_trace(write(tmp_path, name, text))
