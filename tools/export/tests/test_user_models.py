"""Models as users write them: patterns that are ordinary in user code and that the tracers
tripped over (a submodule named like a tracer attribute, audio transformers, a model's own
example inputs). Each exports, and its stages
reproduce the model at every cut; the Rust tests run the same bundles split over gRPC.

Run from tools/export (the exporter imports `tests.models:NAME` as a module path).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.fx as fx
from torch import nn

from cleave_export import ExportError, cli
from cleave_export.bundle import ExportOptions, export_bundle
from cleave_export.sources import load_source
from cleave_export.tracing import RENAMED, graph_module
from tests.test_export import Bundle, assert_close, reference, run_stages


def _export(tmp_path, source: str, **kw) -> Bundle:
    out = tmp_path / "bundle"
    report = export_bundle(ExportOptions(source=source, out=out, **kw))
    return Bundle(source, None, out, json.loads((out / "manifest.json").read_text()), report.manifest)


def _every_split_equals_the_whole(b: Bundle, batches=(1, 3)) -> None:
    stages = b.stages()
    for batch in batches:
        inputs, expected = reference(b, batch)
        whole = run_stages(stages, inputs)
        for got, want in zip(whole, expected, strict=True):
            assert_close(got, want)
        for s in range(len(stages) + 1):
            got = run_stages(stages[s:], run_stages(stages[:s], inputs))
            assert all(torch.equal(g, w) for g, w in zip(got, whole, strict=True)), f"split at cut {s} differs"


def test_a_submodule_named_meta_is_renamed_in_the_graph_and_its_stages_keep_its_path(tmp_path):
    b = _export(tmp_path, "tests.models:image_and_metadata", granularity="op")
    m = b.manifest
    assert m["exporter"]["renamed"] == {"meta": "cleave_meta"}
    names = [s["name"] for s in m["stages"]]
    assert "meta.0" in names and not any("cleave_meta" in n for n in names), names
    modules = [p for s in m["stages"] for p in s["modules"]]
    assert "meta.0" in modules and not any(p.startswith("cleave_meta") for p in modules), modules
    # The stage files hold it under the graph's name, which the manifest's parameter names give.
    held = [p for s in m["stages"] for p in s["parameter_names"] if "meta" in p]
    assert held == ["cleave_meta.0.weight", "cleave_meta.0.bias"]
    _every_split_equals_the_whole(b)


def test_a_model_without_a_clash_renames_nothing(tmp_path):
    b = _export(tmp_path, "tests.models:tiny_residual", granularity="op")
    assert b.manifest["exporter"]["renamed"] == {}


class _Clashing(nn.Module):
    """A submodule and a parameter named like GraphModule attributes, and a name already taken."""

    def __init__(self):
        super().__init__()
        self.graph = nn.Linear(3, 3)
        self.code = nn.Parameter(torch.randn(3))
        self.cleave_graph = nn.Linear(3, 3)

    def forward(self, x):
        return self.cleave_graph(self.graph(x)) + self.code


def test_every_clashing_attribute_is_renamed_to_a_free_name_and_computes_the_same():
    model = _Clashing().eval()
    traced = fx.Tracer().trace(model)
    gm = graph_module(model, traced, "Clashing")
    assert gm.meta[RENAMED] == {"code": "cleave_code", "graph": "_cleave_graph"}
    assert not gm.training
    x = torch.randn(2, 3)
    assert torch.equal(gm(x), model(x))
    assert gm.get_submodule("_cleave_graph") is model.graph and gm.get_parameter("cleave_code") is model.code


def test_a_transformers_model_s_own_example_inputs_are_honoured(tmp_path):
    # A wav2vec2 (main input `input_values`, a waveform) saying it takes 800 samples, not
    # the second at 16 kHz the exporter would feed it; its SpecAugment and LayerDrop, which
    # draw in Python while training, are turned off.
    b = _export(tmp_path, "tests.models:wav2vec2_with_its_own_inputs", batch_max=8)
    m = b.manifest
    assert [(i["name"], i["spec"]["dtype"], i["spec"]["shape"]) for i in m["inputs"]] == [("input_values", "float32", ["B", 800])]
    assert m["exporter"]["tracer"] == "torch.export"
    assert sum(c["usable"] for c in m["cuts"]) >= 8
    _every_split_equals_the_whole(b)


def test_audio_transformers_are_fed_a_waveform_or_log_mel_features():
    wav2vec2 = load_source("tests.models:tiny_wav2vec2", None, 0)
    assert wav2vec2.input_names == ["input_values"] and wav2vec2.example_inputs(0, 2)[0].shape == (2, 16000)
    assert not wav2vec2.model.config.apply_spec_augment and wav2vec2.model.config.layerdrop == 0.0
    whisper = load_source("tests.models:tiny_whisper_encoder", None, 0)
    assert whisper.input_names == ["input_features"] and whisper.example_inputs(0, 2)[0].shape == (2, 16, 64)
    shorter = load_source("tests.models:tiny_wav2vec2", (4000,), 0)
    assert shorter.example_inputs(0, 3)[0].shape == (3, 4000)


def test_a_waveform_model_takes_any_length_its_frames_allow(tmp_path):
    # With --dynamic-seq, S counts wav2vec2's frames: a waveform of 20*S+20 samples (its
    # strides multiply to 20, its first frame takes 40 samples) makes exactly S, and every size
    # inside the model is then a line in S, which the specs say.
    b = _export(tmp_path, "tests.models:tiny_wav2vec2", batch_max=8, seq=(4, 40))
    m = b.manifest
    assert [(i["name"], i["spec"]["shape"]) for i in m["inputs"]] == [("input_values", ["B", "20*S+20"])]
    shapes = [v["spec"]["shape"] for c in m["cuts"] for v in c["values"]]
    assert ["B", 16, "4*S+3"] in shapes and ["B", 16, "2*S+1"] in shapes and ["B", "S", 32] in shapes, shapes
    assert sum(c["usable"] for c in m["cuts"]) >= 10 and m["exporter"]["merged_cuts"] == []
    model = load_source("tests.models:tiny_wav2vec2", None, 0).model.eval()
    stages = b.stages()
    for frames in (4, 13, 40):  # 13 was neither probed nor validated
        wave = torch.randn(3, 20 * frames + 20)
        whole = run_stages(stages, [wave])
        with torch.no_grad():
            assert_close(whole[0], model(input_values=wave).logits)
        for s in range(len(stages) + 1):
            got = run_stages(stages[s:], run_stages(stages[:s], [wave]))
            assert all(torch.equal(g, w) for g, w in zip(got, whole, strict=True)), f"{frames} frames: split at cut {s} differs"


def test_the_frames_of_a_waveform_follow_the_model_s_strides():
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    from cleave_export.huggingface import waveform_lattice
    from tests import models

    assert waveform_lattice(models.tiny_wav2vec2()) == (20, 20)
    # wav2vec2's own feature encoder (strides 5, 2, 2, 2, 2, 2, 2; first frame 400 samples).
    config = Wav2Vec2Config(
        num_hidden_layers=1, hidden_size=8, num_attention_heads=2, intermediate_size=8, conv_dim=(8,) * 7, num_conv_pos_embedding_groups=2
    )
    assert waveform_lattice(Wav2Vec2Model(config)) == (320, 80)
    assert waveform_lattice(nn.Linear(2, 2)) is None


def test_log_mel_features_of_one_length_refuse_a_dynamic_length_saying_what_to_do_instead(tmp_path):
    with pytest.raises(ExportError, match=r"input_features of one length only .* --input-shape instead of --dynamic-seq"):
        export_bundle(ExportOptions(source="tests.models:tiny_whisper_encoder", out=tmp_path / "b", seq=(8, 64)))


def test_example_inputs_that_do_not_follow_the_batch_size_are_named_as_such(tmp_path):
    # Not the last stage's fault, as the message said when it blamed stage k - 1 for cut 0.
    with pytest.raises(ExportError) as e:
        _export(tmp_path, "tests.models:rows_whatever_the_batch")
    assert str(e.value).startswith(
        "at batch 1, the model's example inputs give cut 0 value 'x': expected float32[1, 4], got float32[2, 4]; "
        "what to try: make example_inputs follow the batch size"
    ), e.value


def test_layerdrop_copied_into_modules_when_built_is_turned_off_too():
    # Whisper's encoder copies encoder_layerdrop when built: turning off the config is not enough.
    from transformers import WhisperConfig, WhisperForAudioClassification

    from cleave_export.huggingface import without_training_draws

    config = WhisperConfig(
        encoder_layers=1, decoder_layers=1, d_model=8, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=8,
        decoder_ffn_dim=8, num_mel_bins=4, max_source_positions=4, encoder_layerdrop=0.2, decoder_layerdrop=0.3,
    )
    model = WhisperForAudioClassification(config)
    assert model.encoder.layerdrop == 0.2
    without_training_draws(model, "whisper")
    assert model.encoder.layerdrop == 0.0 and config.encoder_layerdrop == 0.0 and config.decoder_layerdrop == 0.0


def test_fields_read_off_an_output_object_stay_with_the_call_that_made_it(tmp_path):
    # A named tuple out of a module kept whole, read by attribute: the reads join the module's
    # stage, so the container never crosses a cut (TorchScript cannot read `.scaled` off a tuple).
    b = _export(tmp_path, "tests.models:reads_fields_of_an_output", granularity="op")
    assert [s["name"] for s in b.manifest["stages"]] == ["pre", "branch", "mul", "post"]
    assert b.manifest["exporter"]["kept_whole"] == ["branch"]
    assert all(v["spec"]["type"] == "tensor" for c in b.manifest["cuts"] for v in c["values"])
    _every_split_equals_the_whole(b)


FAILURES = [
    # (source, the part named, the reason, what to try), one per class of failure met so far.
    # A list into a module that cannot be scripted: the cut before it moves, and the two
    # modules, traced as one stage, freeze a value of the example (numpy).
    ("tests.models:list_into_unscriptable", "stage 1 (modules 'lists', 'combine')", "traced, not scripted", "make it scriptable"),
    ("tests.models:takes_a_dict", "TakesADict.example_inputs() item 0", "is a dict", "export a module around the model"),
    (
        "tests.models:branches_in_its_own_forward", "BranchesInItsOwnForward.forward", "cannot trace",
        "move the code of forward that depends on the data into a submodule",
    ),
    ("tests.models:through_numpy", "stage 0 (module 'scale')", "traced, not scripted", "make it scriptable"),
]


@pytest.mark.parametrize("source,part,reason,what_to_try", FAILURES, ids=[f[0].split(":")[1] for f in FAILURES])
def test_a_failure_inside_the_tracers_is_one_line_naming_the_part_the_reason_and_what_to_try(
    tmp_path, capsys, source, part, reason, what_to_try
):
    assert cli.main([source, "--granularity", "op", "--out", str(tmp_path / "b")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("cleave_export: error:")]
    assert len(lines) == 1, lines
    line = lines[0]
    assert part in line and reason in line and f"what to try: {what_to_try}" in line, line
    assert "unexpectedly" not in line and not (tmp_path / "b").exists()


def test_an_unforeseen_failure_names_the_innermost_code_of_ours_or_the_user_s_not_torch_s(tmp_path, capsys, monkeypatch):
    def fails_inside_torch(opts):
        return torch.jit.script(lambda x: x.numpy())  # raises deep inside torch.jit

    monkeypatch.setattr(cli, "export_bundle", fails_inside_torch)
    assert cli.main(["tests.models:tiny_residual", "--out", str(tmp_path / "b")]) == 2
    line = capsys.readouterr().err.strip()
    assert "failed in test_user_models.py:" in line and "(fails_inside_torch)" in line, line
    assert "what to try: run with --verbose for the traceback" in line, line


def test_a_list_a_stage_cannot_take_moves_the_cut_before_that_stage_and_says_why(tmp_path):
    # `halves` returns a list; `combine`, which takes it, can only be traced, and a trace takes
    # tensors: the cut between them goes, and the two run as one traced stage.
    b = _export(tmp_path, "tests.models:list_into_traceable", granularity="op")
    m = b.manifest
    assert [(s["name"], s["compiler"]) for s in m["stages"]] == [("pre", "script"), ("halves .. combine", "trace"), ("post", "script")]
    [moved] = m["exporter"]["merged_cuts"]
    assert moved.startswith("after halves: stage 2 (module 'combine') cannot be compiled with torch.jit.script (")
    assert moved.endswith("nor traced, as it takes a list: the cut is moved before the stage")
    _every_split_equals_the_whole(b)


def test_an_in_place_dropout_recorded_by_torch_export_drops_out_only_when_training(tmp_path):
    b = _export(tmp_path, "tests.models:unpacks_with_inplace_dropout", granularity="op")
    assert b.manifest["exporter"]["tracer"] == "torch.export"
    _every_split_equals_the_whole(b)  # in eval mode: no dropout
    stages = b.stages()
    for stage in stages:
        stage.train()
    x = reference(b, 3)[0]
    torch.manual_seed(0)
    trained = run_stages(stages, x)[0]
    assert not torch.equal(trained, run_stages([s.eval() for s in stages], x)[0]), "dropout in training mode"


def test_a_wrapper_torch_export_cannot_rebuild_falls_back_to_fx_keeping_the_transformers_model_whole(tmp_path, caplog):
    # torch.export cannot rebuild a module with a child named `meta` (a graph module's own
    # name); the export goes on with fx's trace, the transformers model one stage.
    b = _export(tmp_path, "tests.models:wrapped_gpt2_with_meta", batch_max=8, reference_batches=[1, 3])
    m = b.manifest
    assert m["exporter"]["tracer"] == "torch.fx" and m["exporter"]["renamed"] == {"meta": "cleave_meta"}
    assert "inner.transformer" in [s["name"] for s in m["stages"]]
    assert "what to try: rename the submodule 'meta'" in caplog.text and "keeping inner.transformer whole" in caplog.text
    _every_split_equals_the_whole(b)
