"""Hugging Face transformers built from small configs (random weights, nothing downloaded):
exported through torch.export, cut between layers, with a symbolic sequence length; and the
one-line errors of exports that cannot succeed.

Each model is exported once per module into pytest's temporary directory (a few seconds each).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from cleave_export import ExportError, cli, huggingface
from cleave_export.bundle import ExportOptions, export_bundle
from cleave_export.specs import check_value, flatten_tensors

EXPORT_ROOT = Path(__file__).resolve().parent.parent
REL_TOL = 1e-5

SMALL = {
    "GPT2LMHeadModel": {"n_layer": 3, "n_embd": 32, "n_head": 4, "n_inner": 64, "vocab_size": 300, "n_positions": 64},
    "LlamaForCausalLM": {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "intermediate_size": 64, "vocab_size": 300, "max_position_embeddings": 64},
    "BertForSequenceClassification": {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                      "intermediate_size": 64, "vocab_size": 300, "max_position_embeddings": 64, "num_labels": 3},
    "ViTForImageClassification": {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                  "intermediate_size": 64, "image_size": 16, "patch_size": 8, "num_labels": 5,
                                  "hidden_dropout_prob": 0.1},
}
LAYERS = {"GPT2LMHeadModel": "transformer.h", "LlamaForCausalLM": "model.layers",
          "BertForSequenceClassification": "bert.encoder.layer", "ViTForImageClassification": "vit.layers"}
TEXT = ["GPT2LMHeadModel", "LlamaForCausalLM", "BertForSequenceClassification"]


@pytest.fixture(scope="module", params=list(SMALL))
def exported(request, tmp_path_factory):
    name = request.param
    out = tmp_path_factory.mktemp("hf") / name
    seq = (1, 24) if name in TEXT else None
    report = export_bundle(ExportOptions(f"hf:{name}", out, hf_config=SMALL[name], batch_max=8,
                                         reference_batches=(1, 3, 8), seq=seq))
    return name, out, report.manifest


def test_inputs_are_token_ids_with_a_symbolic_sequence(exported):
    name, _, m = exported
    assert m["exporter"]["tracer"] == "torch.export"
    if name not in TEXT:
        assert m["inputs"] == [{"name": "pixel_values", "spec": {"type": "tensor", "dtype": "float32", "shape": ["B", 3, 16, 16]}}]
        assert "sequence" not in m
        return
    assert m["sequence"] == {"min": 1, "max": 24}
    vocab = SMALL[name]["vocab_size"]
    assert m["inputs"] == [
        {"name": "input_ids", "spec": {"type": "tensor", "dtype": "int64", "shape": ["B", "S"]}, "range": [0, vocab - 1]},
        {"name": "attention_mask", "spec": {"type": "tensor", "dtype": "int64", "shape": ["B", "S"]}, "range": [0, 1]},
    ]
    # The hidden state between layers follows the sequence; bytes are counted at the longest.
    hidden = SMALL[name].get("n_embd") or SMALL[name]["hidden_size"]
    between = [c for c in m["cuts"] if c["name"].startswith(f"after {LAYERS[name]}.0")]
    assert between and any(t["shape"] == ["B", "S", hidden] for t in between[0]["tensors"])
    assert between[0]["bytes_per_sample"] >= 24 * hidden * 4


def test_block_granularity_cuts_between_every_layer(exported):
    name, _, m = exported
    layers = [c["name"] for c in m["cuts"] if c["name"].startswith(f"after {LAYERS[name]}.")]
    count = SMALL[name].get("n_layer") or SMALL[name]["num_hidden_layers"]
    assert layers == [f"after {LAYERS[name]}.{i}" for i in range(count)]
    assert all(c["usable"] for c in m["cuts"])
    # Sizes are computed again in each stage, never sent: no plain int crosses a cut.
    assert not [c for c in m["cuts"] if any(v["spec"]["type"] != "tensor" for v in c["values"])]


def test_output_is_the_model_output_as_a_dict(exported):
    _, _, m = exported
    assert m["output"]["type"] == "dict"
    assert [i["key"] for i in m["output"]["items"]] == ["logits"]


def test_references_at_three_batches_and_two_lengths_match_the_stage_chain(exported):
    name, out, m = exported
    refs = m["references"]
    if name in TEXT:
        assert sorted((r["batch_size"], r["seq_len"]) for r in refs) == [(b, s) for b in (1, 3, 8) for s in (8, 24)]
    else:
        assert sorted(r["batch_size"] for r in refs) == [1, 3, 8]
    stages = [torch.jit.load(str(out / s["file"])).eval() for s in m["stages"]]
    for r in refs:
        ref = load_file(str(out / r["file"]))
        values = [ref[f"input.{v['name']}"] for v in m["inputs"]]
        with torch.no_grad():
            for k, stage in enumerate(stages):
                values = list(stage(*values))
                for v, x in zip(m["cuts"][k + 1]["values"], values):
                    check_value(v["spec"], x, r["batch_size"], f"cut {k + 1} {v['name']}", r.get("seq_len"))
        for v, x in zip(m["cuts"][-1]["values"], values):
            for key, got in flatten_tensors(v["name"], x):
                want = ref[f"output.{key}"]
                assert got.shape == want.shape
                assert (got - want).abs().max().item() <= REL_TOL * want.abs().max().item()


def test_dropout_recorded_in_training_mode_follows_the_stage_mode(exported):
    name, out, m = exported
    if name == "LlamaForCausalLM":
        pytest.skip("Llama has no dropout by default")
    stage = next(s for s in m["stages"] if "dropout" in s["name"] or any("drop" in p for p in s["modules"]))
    module = torch.jit.load(str(out / stage["file"]))
    ref = load_file(str(out / m["references"][-1]["file"]))
    values = [ref[f"input.{v['name']}"] for v in m["inputs"]]
    with torch.no_grad():
        for s in m["stages"][: stage["index"]]:
            values = list(torch.jit.load(str(out / s["file"])).eval()(*values))
        module.eval()
        assert all(torch.equal(a, b) for a, b in zip(module(*values), module(*values)))
        module.train()
        torch.manual_seed(0)
        first = module(*values)
        torch.manual_seed(1)
        assert not all(torch.equal(a, b) for a, b in zip(first, module(*values)))


def test_tied_embedding_and_head_are_named_by_every_alias(exported):
    name, _, m = exported
    shared = m["exporter"]["shared_parameters"]
    if name != "GPT2LMHeadModel":
        assert shared == []
        return
    [tie] = shared
    assert tie["aliases"] == ["transformer.wte.weight", "lm_head.weight"]
    assert tie["stages"][0] < tie["stages"][1] == len(m["stages"]) - 1


def test_untied_lm_exports_without_shared_parameters(tmp_path):
    config = SMALL["GPT2LMHeadModel"] | {"n_layer": 1, "tie_word_embeddings": False}
    m = export_bundle(ExportOptions("hf:GPT2LMHeadModel", tmp_path / "b", hf_config=config, batch_max=4, seq=(2, 8))).manifest
    assert m["exporter"]["shared_parameters"] == []


# ---------------------------------------------------------------------------------------------
# Exports that cannot succeed: one line naming the part, the reason and what to try; exit 2.


class DataDependentForward(nn.Module):
    """Branches on the data in its own forward: neither torch.fx nor torch.export can trace it."""

    input_shape = (4,)

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:
            return y[y > 0]
        return y


class ExampleInputsFail(nn.Module):
    """Its example_inputs raises something the exporter does not foresee."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)

    def example_inputs(self, batch):
        return {}["no such key"]


class TwoInputs(nn.Module):
    """Takes two images, as optical flow does; the exporter feeds one."""

    input_shape = (4,)

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, first, second):
        return self.fc(first - second)


def two_inputs():
    return TwoInputs()


def data_dependent_forward():
    return DataDependentForward()


def example_inputs_fail():
    return ExampleInputsFail()


def test_hf_config_fields_reach_the_fields_the_config_derives_from_them():
    # LlamaConfig derives head_dim from hidden_size and the heads when it is built: set
    # afterwards, they would leave the default model's head_dim (128) in a width-256 model.
    model = huggingface.build("LlamaForCausalLM", {"num_hidden_layers": 1, "hidden_size": 256, "num_attention_heads": 4,
                                                   "intermediate_size": 64, "vocab_size": 300})
    assert model.config.head_dim == 64
    assert model.model.layers[0].self_attn.q_proj.out_features == 256


def export_in_process(capfd, *argv: str) -> tuple[int, str]:
    """(exit code, stderr) of `python -m cleave_export ARGV -q`, run in this process."""
    code = cli.main([*argv, "-q"])
    return code, capfd.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["hf:NoSuchModel"], "cleave_export: error: transformers has no model class 'NoSuchModel'; name one such as "),
        (["hf:BertModel", "--hf-config", "layers=2"], "cleave_export: error: --hf-config layers=2: BertConfig has no field 'layers'"),
        (["hf:BertModel", "--hf-config", "hidden_size=30,num_attention_heads=4"],
         "cleave_export: error: BertModel cannot be built from this config: ValueError: "),
        (["hf:ViTModel", "--hf-config", "num_hidden_layers=1", "--dynamic-seq", "2", "8"],
         "cleave_export: error: hf:ViTModel takes images; --dynamic-seq is for models that take token ids"),
        (["tests.test_transformers:data_dependent_forward"],
         "cleave_export: error: torch.fx cannot trace DataDependentForward.forward itself: TraceError: "),
        (["tests.test_transformers:two_inputs"],
         "cleave_export: error: TwoInputs.forward takes 2 inputs (first, second) but the exporter feeds 1 (what to try: build "
         "the model in a `pkg.mod:callable` and give it an `example_inputs(batch_size)` method that returns all of them)"),
        # Two layers: BEiT's stochastic depth rises from 0 at the first layer to drop_path_rate at the last.
        (["hf:BeitForImageClassification", "--hf-config", "num_hidden_layers=2,hidden_size=32,num_attention_heads=2,"
          "intermediate_size=64,image_size=32,patch_size=8,drop_path_rate=0.1"],
         "cleave_export: error: beit.layers.1.drop_path draws random numbers in training mode (rand) other than dropout, "
         "stochastic depth (drop path) probably, which a stage would draw in eval mode too (what to try: set its rate to 0, "
         "for a transformers model --hf-config drop_path_rate=0.0)"),
        (["tests.test_transformers:example_inputs_fail"],
         "cleave_export: error: exporting tests.test_transformers:example_inputs_fail failed in "
         "test_transformers.py"),
    ],
)
def test_an_export_that_cannot_succeed_ends_with_one_line(tmp_path, capfd, argv, expected):
    code, err = export_in_process(capfd, *argv, "--out", str(tmp_path / "b"))
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(expected), lines[0]
    assert list(tmp_path.iterdir()) == []


def test_the_one_line_says_what_to_try_and_verbose_adds_the_traceback(tmp_path, capfd):
    _, err = export_in_process(capfd, "tests.test_transformers:data_dependent_forward", "--out", str(tmp_path / "b"))
    assert "what to try: move the code of forward that depends on the data into a submodule" in err
    _, unexpected = export_in_process(capfd, "tests.test_transformers:example_inputs_fail", "--out", str(tmp_path / "b"))
    assert "KeyError: 'no such key'; what to try: run with --verbose for the traceback; " in unexpected
    # As a program: exit code 2, the traceback first with --verbose, the same line last.
    verbose = subprocess.run(
        [sys.executable, "-m", "cleave_export", "tests.test_transformers:example_inputs_fail", "--out", str(tmp_path / "b"), "--verbose"],
        cwd=EXPORT_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert verbose.returncode == 2
    assert "Traceback (most recent call last)" in verbose.stderr
    assert verbose.stderr.splitlines()[-1] == unexpected.splitlines()[-1].replace("run with --verbose for the traceback; ", "")


def test_bad_sequence_range_is_refused(tmp_path):
    with pytest.raises(ExportError, match=r"--dynamic-seq 9 4: need 1 <= MIN <= MAX"):
        export_bundle(ExportOptions("hf:BertModel", tmp_path / "b", hf_config={"num_hidden_layers": 1}, seq=(9, 4)))


def test_manifest_is_json_with_sequence_only_for_text_models(exported):
    _, out, m = exported
    assert json.loads((out / "manifest.json").read_text()) == m
