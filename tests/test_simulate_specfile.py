"""`headroom simulate --spec FILE`'s reading of the file: held to what kubectl and the API server
accept (camelCase names only, typed values, no repeated key, the CRD's apiVersion), in YAML of
either style or JSON, with the line of what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headroom.contract.cli import main
from headroom.operator.simulate.specfile import SpecFile, SpecFileError, read_spec

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
SPEC = {
    "model": {"preset": "llama-3.1-8b"},
    "gpu": {"type": "l4-24gb"},
    "traffic": {"peakConcurrency": 4, "contextTokens": 1000},
}
HEAD = "apiVersion: headroom.dev/v1alpha1\nkind: InferenceDeployment\nmetadata: {name: chat}\n"
PLAIN = "model: {preset: llama-3.1-8b}\ngpu: {type: l4-24gb}\n"


def refused(tmp_path: Path, text: str, name: str = "spec.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(SpecFileError) as info:
        read_spec(path)
    msg = str(info.value)
    assert msg.startswith(str(path)), msg
    return msg.removeprefix(str(path))


def accepted(tmp_path: Path, text: str, name: str = "spec.yaml") -> SpecFile:
    path = tmp_path / name
    path.write_text(text)
    return read_spec(path)


# ------------------------------------------------------------------------ field names (bug 1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            PLAIN + "traffic: {peak_concurrency: 4, context_tokens: 1000}\n",
            ":3: spec.traffic.peak_concurrency: Extra inputs are not permitted (the API server "
            "knows this field only as peakConcurrency)",
        ),
        (
            PLAIN + "traffic: {peakConcurrency: 4, contextTokens: 1000}\n"
            "engine: {max_model_len: 16384}\n",
            ":4: spec.engine.max_model_len: Extra inputs are not permitted (the API server knows "
            "this field only as maxModelLen)",
        ),
        (
            "model:\n  path: /m\n  preset: llama-3.1-8b\n  num_kv_heads: 8\ngpu: {type: l4-24gb}\n"
            "traffic: {peakConcurrency: 4, contextTokens: 1000}\n",
            ":4: spec.model.num_kv_heads: Extra inputs are not permitted (the API server knows "
            "this field only as numKVHeads)",
        ),
        (
            HEAD + "spec:\n  model: {preset: llama-3.1-8b}\n"
            "  gpu: {type: l4-24gb, memory_gib: 24}\n"
            "  traffic: {peakConcurrency: 4, contextTokens: 1000}\n",
            ":6: spec.gpu.memory_gib: Extra inputs are not permitted (the API server knows this "
            "field only as memoryGiB)",
        ),
    ],
)
def test_a_snake_case_field_is_refused_naming_its_camel_case_name(
    tmp_path: Path, text: str, expected: str
) -> None:
    assert refused(tmp_path, text) == expected


def test_a_misspelt_field_is_named_rather_than_the_field_it_leaves_missing(tmp_path: Path) -> None:
    msg = refused(tmp_path, PLAIN + "traffic: {peakConcurency: 4, contextTokens: 1000}\n")
    assert msg == ":3: spec.traffic.peakConcurency: Extra inputs are not permitted"


# ----------------------------------------------------------------------- YAML flow style (bug 2)


def test_yaml_in_flow_style_is_read_as_yaml(tmp_path: Path) -> None:
    sf = accepted(
        tmp_path,
        "{model: {preset: llama-3.1-8b}, gpu: {type: l4-24gb},\n"
        " traffic: {peakConcurrency: 4, contextTokens: 1000}}\n",
    )
    assert sf.spec.traffic.peak_concurrency == 4
    # JSON followed by a document marker is YAML too.
    sf = accepted(tmp_path, json.dumps(SPEC) + "\n---\n")
    assert sf.spec.traffic.context_tokens == 1000


def test_flow_style_yaml_keeps_its_lines(tmp_path: Path) -> None:
    msg = refused(
        tmp_path,
        "{model: {preset: llama-3.1-8b}, gpu: {type: l4-24gb},\n"
        " traffic: {peakConcurrency: 0, contextTokens: 1000}}\n",
    )
    assert msg == ":2: spec.traffic.peakConcurrency: Input should be greater than or equal to 1"


def test_what_is_neither_json_nor_yaml_reports_the_json_error(tmp_path: Path) -> None:
    msg = refused(tmp_path, '{\n\t"model": {"preset": "llama-3.1-8b"},\n\t"gpu": {"type" 1}\n}\n')
    assert msg == ":3: not JSON: Expecting ':' delimiter"
    msg = refused(tmp_path, "{model: {preset: llama-3.1-8b},\n gpu: [unclosed\n")
    assert msg.startswith(":1: not JSON: "), msg


# ------------------------------------------------------------------------ JSON's lines (bug 3)


@pytest.mark.parametrize("indent", [2, "\t", None])
def test_a_json_field_error_names_its_line(tmp_path: Path, indent: int | str | None) -> None:
    spec = {**SPEC, "traffic": {"peakConcurrency": 0, "contextTokens": 1000}}
    text = json.dumps(spec, indent=indent)
    line = next(i for i, s in enumerate(text.splitlines(), 1) if "peakConcurrency" in s)
    msg = refused(tmp_path, text, "spec.json")
    expected = "spec.traffic.peakConcurrency: Input should be greater than or equal to 1"
    assert msg == f":{line}: {expected}"


def test_a_whole_resource_in_json_names_the_line_of_its_field(tmp_path: Path) -> None:
    doc = {"apiVersion": "headroom.dev/v1alpha1", "kind": "InferenceDeployment", "spec": SPEC}
    doc["spec"] = {**SPEC, "scaling": {"minReplicaz": 2}}
    text = json.dumps(doc, indent=1)
    line = next(i for i, s in enumerate(text.splitlines(), 1) if "minReplicaz" in s)
    msg = refused(tmp_path, text, "spec.json")
    assert msg == f":{line}: spec.scaling.minReplicaz: Extra inputs are not permitted"


# ---------------------------------------------------------------------- repeated keys (bug 4)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "model: {preset: llama-3.1-8b}\nmodel: {preset: x}\ngpu: {type: l4-24gb}\n"
            "traffic: {peakConcurrency: 4, contextTokens: 1000}\n",
            ":2: model: duplicate key (first at line 1)",
        ),
        (
            HEAD + "spec:\n  model: {preset: llama-3.1-8b}\n  gpu: {type: l4-24gb}\n"
            "  traffic: {peakConcurrency: 4, contextTokens: 1000}\n"
            "  engine: {maxModelLen: 2048}\n  engine: {maxModelLen: 16384}\n",
            ":9: spec.engine: duplicate key (first at line 8)",
        ),
        (
            PLAIN + "traffic: {peakConcurrency: 4, contextTokens: 1000, 'peakConcurrency': 8}\n",
            ":3: traffic.peakConcurrency: duplicate key (first at line 3)",
        ),
        (
            '{\n\t"model": {"preset": "llama-3.1-8b"},\n\t"gpu": {"type": "l4-24gb"},\n'
            '\t"traffic": {"peakConcurrency": 4, "contextTokens": 1000},\n'
            '\t"gpu": {"type": "h100-80gb"}\n}\n',
            ":5: gpu: duplicate key (first at line 3)",
        ),
    ],
)
def test_a_repeated_key_is_refused_at_its_line(tmp_path: Path, text: str, expected: str) -> None:
    assert refused(tmp_path, text).startswith(expected + "; kubectl refuses")


def test_a_merge_key_is_not_a_repeat_and_the_key_in_force_is_the_one_named(
    tmp_path: Path,
) -> None:
    base = PLAIN + "traffic: {peakConcurrency: 4, contextTokens: 1000}\nengine:\n"
    sf = accepted(tmp_path, base + "  <<: {maxModelLen: 512}\n  maxModelLen: 2048\n")
    assert sf.spec.engine.max_model_len == 2048
    msg = refused(tmp_path, base + "  <<: {maxModelLen: 2048}\n  maxModelLen: 0\n")
    assert msg == ":6: spec.engine.maxModelLen: Input should be greater than or equal to 1"


# ------------------------------------------------------------------------- apiVersion (bug 5)


@pytest.mark.parametrize("api_version", ["apps/v1", "headroom.dev/v1", "1"])
def test_an_api_version_other_than_the_crds_is_refused(tmp_path: Path, api_version: str) -> None:
    text = (
        f"kind: InferenceDeployment\napiVersion: {api_version}\nspec:\n"
        "  model: {preset: llama-3.1-8b}\n  gpu: {type: l4-24gb}\n"
        "  traffic: {peakConcurrency: 4, contextTokens: 1000}\n"
    )
    msg = refused(tmp_path, text)
    assert msg.startswith(":2: apiVersion is "), msg
    assert "not headroom.dev/v1alpha1" in msg


def test_the_crds_api_version_is_accepted(tmp_path: Path) -> None:
    text = HEAD + "spec:\n" + "".join(f"  {line}\n" for line in PLAIN.splitlines())
    sf = accepted(tmp_path, text + "  traffic: {peakConcurrency: 4, contextTokens: 1000}\n")
    assert sf.name == "chat"


# ---------------------------------------------------------------------- typed values (bug 6)


@pytest.mark.parametrize(
    ("traffic", "engine", "expected"),
    [
        (
            'peakConcurrency: "128", contextTokens: 1000',
            "{}",
            ":3: spec.traffic.peakConcurrency: Input should be a valid integer, not the string "
            "'128'",
        ),
        (
            "peakConcurrency: 4, contextTokens: 1000",
            '{prefixCaching: "off"}',
            ":4: spec.engine.prefixCaching: Input should be a valid boolean, not the string 'off'",
        ),
        (
            "peakConcurrency: 4, contextTokens: 1000",
            "{prefixCaching: 0}",
            ":4: spec.engine.prefixCaching: Input should be a valid boolean",
        ),
        (
            "peakConcurrency: 4, contextTokens: 1000",
            '{gpuMemoryUtilization: "0.8"}',
            ":4: spec.engine.gpuMemoryUtilization: Input should be a valid number, not the "
            "string '0.8'",
        ),
        (
            "peakConcurrency: 4.5, contextTokens: 1000",
            "{}",
            ":3: spec.traffic.peakConcurrency: Input should be a valid integer, got a number "
            "with a fractional part",
        ),
        (
            "peakConcurrency: .nan, contextTokens: 1000",
            "{}",
            ":3: spec.traffic.peakConcurrency: Input should be a valid integer",
        ),
    ],
)
def test_a_value_the_api_server_would_refuse_for_its_type_is_refused(
    tmp_path: Path, traffic: str, engine: str, expected: str
) -> None:
    msg = refused(tmp_path, PLAIN + f"traffic: {{{traffic}}}\nengine: {engine}\n")
    assert msg == expected


def test_yaml_numbers_booleans_enums_and_quantities_are_accepted(tmp_path: Path) -> None:
    sf = accepted(
        tmp_path,
        "model: {preset: llama-3.1-8b, weightDtype: bf16}\n"
        "gpu: {type: l4-24gb, memoryGiB: 24, nodeSelector: {nvidia.com/gpu.product: NVIDIA-L4}}\n"
        "traffic: {peakConcurrency: 4.0, contextTokens: 1000, prefixHitRatio: 0}\n"
        "engine:\n  prefixCaching: off\n  kvCacheDtype: fp8\n  cpu: 4\n  memory: 32Gi\n"
        "  gpuMemoryUtilization: 1\n  apiKeySecret: {name: key}\n"
        "scaling: {targetOccupancy: 0.8, mode: advisory, scaleDownStabilizationSeconds: 600}\n",
    )
    spec = sf.spec
    assert spec.traffic.peak_concurrency == 4 and spec.gpu.memory_gib == 24.0
    assert spec.engine.prefix_caching is False and spec.engine.kv_cache_dtype == "fp8"
    assert spec.engine.cpu == "4" and spec.engine.api_key_secret is not None
    assert spec.scaling.mode == "advisory" and spec.scaling.target_occupancy == 0.8
    sf = accepted(tmp_path, PLAIN + "traffic: {peakConcurrency: 4, contextTokens: 1000}\n"
                  "engine: {prefixCaching: yes, cpu: '16'}\n")  # fmt: skip
    assert sf.spec.engine.prefix_caching is True and sf.spec.engine.cpu == "16"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_is_read(example: Path) -> None:
    sf = read_spec(example)
    assert sf.sizing.feasible


# ----------------------------------------------------------------- a leading null document (bug 7)


def test_a_null_document_before_the_resource_keeps_the_lines(tmp_path: Path) -> None:
    text = (
        "--- ~\n---\n" + HEAD + "spec:\n  model: {preset: llama-3.1-8b}\n  gpu: {type: l4-24gb}\n"
        "  traffic: {peakConcurrency: 0, contextTokens: 1000}\n"
    )
    msg = refused(tmp_path, text)
    assert msg == ":9: spec.traffic.peakConcurrency: Input should be greater than or equal to 1"


# ------------------------------------------------------------------------------ from the CLI


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (PLAIN + "traffic: {peak_concurrency: 4, context_tokens: 1000}\n", ":3: spec.traffic."),
        ("apiVersion: apps/v1\nkind: InferenceDeployment\nspec: {}\n", ":1: apiVersion is"),
        (PLAIN + "model: {preset: x}\n", ":3: model: duplicate key"),
    ],
)
def test_simulate_exits_2_with_the_line_and_no_traceback(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, needle: str
) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text(text)
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,100,10\n")
    code = main(["simulate", str(trace), "--spec", str(spec), "--seeds", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"headroom simulate: {spec}{needle}"), err
    assert "Traceback" not in err


# ------------------------------------------------------- metadata and the top level (the CRD's)

BODY = "spec:\n  model: {preset: llama-3.1-8b}\n  gpu: {type: l4-24gb}\n" \
    "  traffic: {peakConcurrency: 4, contextTokens: 1000}\n"  # fmt: skip
KIND_LINES = "apiVersion: headroom.dev/v1alpha1\nkind: InferenceDeployment\n"
DNS_1035 = (
    "metadata.name must be a DNS-1035 label: at most 63 lower-case letters, digits and '-', "
    "starting with a letter and ending with a letter or digit (it names the Service and labels "
    "the pods)"
)


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ("metadata: {name: Bad_Name.x}\n", f":3: {DNS_1035}, got 'Bad_Name.x'"),
        ("metadata:\n  labels: {a: b}\n  name: chat-\n", f":5: {DNS_1035}, got 'chat-'"),
        (f"metadata: {{name: {'a' * 64}}}\n", f":3: {DNS_1035}, got '{'a' * 64}'"),
        ("metadata: {name: 42}\n", ":3: metadata.name must be a string, got 42"),
        ("metadata: chat\n", ":3: metadata must be a mapping, got a str"),
        ("metadata: [chat]\n", ":3: metadata must be a mapping, got a list"),
        (
            "metadata: {name: chat}\nspecs: {}\n",
            ":4: specs: field not declared in the InferenceDeployment schema (it takes "
            "apiVersion, kind, metadata, spec, status)",
        ),
    ],
)
def test_metadata_and_top_level_keys_the_api_server_refuses_are_refused(
    tmp_path: Path, metadata: str, expected: str
) -> None:
    assert refused(tmp_path, KIND_LINES + metadata + BODY) == expected


@pytest.mark.parametrize(
    ("metadata", "name"),
    [
        ("", "my-spec"),  # no metadata: the file's stem names it
        ("metadata: {}\n", "my-spec"),
        ("metadata: {name: null, labels: {a: b}}\n", "my-spec"),
        (f"metadata: {{name: {'a' * 63}}}\nstatus: {{replicas: 2}}\n", "a" * 63),
        ("metadata: {name: chat-l4}\n", "chat-l4"),
    ],
)
def test_a_resource_the_api_server_takes_is_read_with_its_name(
    tmp_path: Path, metadata: str, name: str
) -> None:
    sf = accepted(tmp_path, KIND_LINES + metadata + BODY, "my-spec.yaml")
    assert sf.name == name and sf.raw["traffic"] == {"peakConcurrency": 4, "contextTokens": 1000}


# ------------------------------------------------------------- which document, which resource


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "found 0 among 0 documents"),
        ("--- ~\n---\n", "found 0 among 0 documents"),
        (PLAIN + "---\n" + PLAIN, "found 0 among 2 documents"),
        (KIND_LINES + BODY + "---\n" + KIND_LINES + BODY, "found 2 among 2 documents"),
    ],
)
def test_a_file_without_exactly_one_resource_or_one_spec_is_refused(
    tmp_path: Path, text: str, expected: str
) -> None:
    """Nothing to read, or several documents none (or more than one) an InferenceDeployment:
    no document is picked for the user."""
    msg = refused(tmp_path, text)
    assert msg == f": expected one InferenceDeployment (or its spec), {expected}"


def test_a_manifest_of_another_kind_is_named_by_its_kind_though_it_has_no_spec(
    tmp_path: Path,
) -> None:
    """`kind` alone marks a resource: a Service passed by mistake is named, not read as a spec
    with unknown fields."""
    msg = refused(tmp_path, "apiVersion: v1\nkind: Service\nmetadata: {name: chat}\n")
    assert msg == ":2: kind is 'Service', not InferenceDeployment"


def test_a_type_error_on_a_field_named_the_same_in_both_cases_gets_no_alias_note(
    tmp_path: Path,
) -> None:
    """The camelCase note is for an unknown snake_case field only, not for a wrong value of a
    field whose two names agree (`preset`, `cpu`)."""
    msg = refused(tmp_path, "model: {preset: 5}\ngpu: {type: l4-24gb}\n")
    assert msg == ":1: spec.model.preset: Input should be a valid string"
    traffic = "traffic: {peakConcurrency: 4, contextTokens: 1000}\n"
    msg = refused(tmp_path, PLAIN + traffic + "engine: {cpu: [4]}\n")
    assert msg == ":4: spec.engine.cpu: Input should be a valid string"


@pytest.mark.parametrize(
    "before",
    [
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: chat}\n---\n",
        "- a list\n---\n",
    ],
)
def test_the_one_inference_deployment_among_other_documents_is_read(
    tmp_path: Path, before: str
) -> None:
    """A manifest bundle (a Namespace, then the resource) is read for its InferenceDeployment
    alone."""
    sf = accepted(tmp_path, before + HEAD + BODY)
    assert sf.name == "chat" and sf.spec.traffic.peak_concurrency == 4


# ------------------------------------------------------------------------- more of the lines


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # A missing field is found at its parent's key, not at the parent's first value.
        (
            PLAIN + "traffic:\n  contextTokens: 1000\n",
            ":3: spec.traffic.peakConcurrency: Field required",
        ),
        (
            PLAIN + "traffic: peakConcurrency: 4\n",
            ":3: not YAML or JSON: mapping values are not allowed here",
        ),
        # An optional object (`SecretKeySelector | None`) is walked for the field's name too.
        (
            PLAIN + "traffic: {peakConcurrency: 4, contextTokens: 1000}\n"
            "engine:\n  apiKeySecret:\n    name: key\n    secret_key: x\n",
            ":7: spec.engine.apiKeySecret.secret_key: Extra inputs are not permitted",
        ),
        # A key that is a sequence: YAML refuses it, as the Python loader cannot hash it.
        (
            PLAIN + "engine:\n  ? [a, b]\n  : 1\n",
            ":4: not YAML or JSON: found unhashable key",
        ),
    ],
)
def test_what_is_wrong_is_named_at_its_line(tmp_path: Path, text: str, expected: str) -> None:
    assert refused(tmp_path, text) == expected


def test_a_json_integer_too_long_to_convert_is_refused_with_the_reason(tmp_path: Path) -> None:
    """Python's limit on integer digits is the reason given, not a traceback or its detail."""
    text = '{"traffic": {"peakConcurrency": 1' + "0" * 5000 + "}}"
    msg = refused(tmp_path, text, "spec.json")
    assert (
        msg
        == ": not JSON this reads: Exceeds the limit (4300 digits) for integer string conversion"
    )


def test_a_spec_the_planner_refuses_is_refused_with_its_reason(tmp_path: Path) -> None:
    """Valid to the schema but not to the planner (parse() sizes it): its reason, no traceback."""
    text = (
        "model: {preset: llama-3.1-8b, path: tiny}\ngpu: {type: l4-24gb}\n"
        "traffic: {peakConcurrency: 4, contextTokens: 1000}\nengine: {runtime: vllm}\n"
    )
    msg = refused(tmp_path, text)
    assert "spec: engine.runtime vllm cannot load 'tiny'" in msg, msg


RESOURCE = "apiVersion: headroom.dev/v1alpha1\nkind: InferenceDeployment\nmetadata: {name: chat}\n"


@pytest.mark.parametrize(
    ("body", "line", "reason"),
    [
        # The sizing's refusals name their field: a weights path the runtime cannot load...
        ("  model:\n    preset: llama-3.1-8b\n    path: tiny\n  gpu: {type: l4-24gb}\n"
         "  traffic: {peakConcurrency: 4, contextTokens: 1000}\n  engine: {runtime: vllm}\n",
         7, "cannot load 'tiny'"),
        # ... a preset the headroom engine does not implement ...
        ("  gpu: {type: h200}\n  model:\n    path: /m\n    preset: mixtral-8x7b\n"
         "  traffic: {peakConcurrency: 4, contextTokens: 1000}\n",
         8, "mixtral-8x7b is a MixtralForCausalLM"),
        # ... and a rule over two fields points at its fieldPath, not at spec.
        ("  model: {preset: llama-3.1-8b}\n  gpu: {type: l4-24gb}\n"
         "  traffic: {peakConcurrency: 4, contextTokens: 1000}\n  engine:\n"
         "    runtime: headroom\n    maxModelLen: 512\n",
         10, "engine.maxModelLen must be at least traffic.contextTokens"),
    ],
)  # fmt: skip
def test_a_refusal_about_one_field_is_placed_at_that_fields_line(
    tmp_path: Path, body: str, line: int, reason: str
) -> None:
    """The planner's refusals and the CRD's cross-field rules carry the field they are about,
    so the file's line is that field's, not the line of `spec:` (or none for a bare spec)."""
    msg = refused(tmp_path, RESOURCE + "spec:\n" + body)
    assert msg.startswith(f":{line}: spec") and reason in msg, msg
    bare = "".join(row.removeprefix("  ") + "\n" for row in body.splitlines())
    assert refused(tmp_path, bare).startswith(f":{line - 4}: spec")
