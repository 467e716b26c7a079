"""Stages for split generation (`--generation`): each layer takes its key/value cache, and the
chain gives transformers' logits with its own cache, a prompt then one token at a time."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from cleave_export import ExportError
from cleave_export.bundle import ExportOptions, export_bundle
from cleave_export.generation import REFERENCE_FILE, run_generation, write_generation

SMALL_GPT2 = {"n_layer": 4, "n_embd": 32, "n_head": 4, "n_inner": 64, "vocab_size": 500, "n_positions": 64}


@pytest.fixture(scope="module")
def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**SMALL_GPT2)).eval()


@pytest.fixture(scope="module")
def written(gpt2, tmp_path_factory):
    out = tmp_path_factory.mktemp("generation")
    section = write_generation(gpt2, out, seed=0)
    stages = [torch.jit.load(str(out / s["file"])).eval() for s in section["stages"]]
    return section, stages, load_file(str(out / REFERENCE_FILE))


def test_the_saved_stages_give_transformers_logits_with_its_cache(written):
    section, stages, reference = written
    assert [s["name"] for s in section["stages"]] == ["embed", *(f"transformer.h.{i}" for i in range(4)), "head"]
    caches = [s.get("cache") for s in section["stages"]]
    assert caches[0] is None and caches[-1] is None
    assert all(c == {"dtype": "float32", "heads": 4, "head_dim": 8, "bytes_per_token": 2 * 32 * 4} for c in caches[1:-1])
    ref = section["reference"]
    assert (ref["prompt"], ref["steps"], ref["relative_error"] <= 1e-4) == (7, 32, True)
    ids, want = reference["input_ids"], reference["logits"]
    assert ids.shape == (2, 39) and want.shape == (2, 39, 500)
    got = run_generation(stages, ids, ref["prompt"], ref["max_len"])
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4


def test_a_cache_of_any_length_gives_the_same_logits(written):
    # The cache's length is the session's max_len: more masked positions add nothing but
    # rounding (the matrix products sum in other blocks).
    _, stages, reference = written
    ids = reference["input_ids"]
    short, long = run_generation(stages, ids, 7, 39), run_generation(stages, ids, 7, 64)
    assert ((short - long).abs().max() / short.abs().max()).item() <= 1e-6


def test_sessions_at_different_positions_run_as_one_batch(written):
    # Two sessions, prompts of 7 and 3 tokens, then decode steps batched together, each row
    # at its own position: every step's logits as when each runs alone.
    _, stages, reference = written
    ids = reference["input_ids"]
    alone = [run_generation(stages, ids[r : r + 1, : prompt + 5], prompt, 32) for r, prompt in ((0, 7), (1, 3))]
    caches = [torch.zeros(2, 2, 4, 32, 8) for _ in stages[1:-1]]
    with torch.no_grad():
        for row, prompt in ((0, 7), (1, 3)):  # each prefill alone, into its row of the caches
            positions = torch.arange(prompt)[None, :]
            hidden = stages[0](ids[row : row + 1, :prompt], positions)
            for layer, cache in zip(stages[1:-1], caches):
                own = cache[:, row : row + 1].clone()
                hidden = layer(hidden, positions, own)
                cache[:, row : row + 1] = own
        for step in range(5):
            positions = torch.tensor([[7 + step], [3 + step]])
            hidden = stages[0](torch.stack([ids[0, 7 + step], ids[1, 3 + step]])[:, None], positions)
            for layer, cache in zip(stages[1:-1], caches):
                hidden = layer(hidden, positions, cache)
            logits = stages[-1](hidden)
            for row, prompt in ((0, 7), (1, 3)):
                want = alone[row][0, prompt + step]
                assert ((logits[row, 0] - want).abs().max() / want.abs().max()).item() <= 1e-5, (row, step)


def test_greedy_tokens_are_transformers_generate_s(gpt2, written):
    _, stages, reference = written
    prompt = reference["input_ids"][:, :7]
    want = gpt2.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=16, pad_token_id=0)
    ids = prompt
    for _ in range(16):
        logits = run_generation(stages, ids, ids.size(1), 32)[:, -1]
        top2 = logits.topk(2).values
        assert ((top2[:, 0] - top2[:, 1]) > 1e-4).all(), "a near tie: the test's seed needs changing"
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(ids, want)


SMALL_LLAMA = {
    "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
    "vocab_size": 500, "max_position_embeddings": 64,
}


@pytest.mark.parametrize(("family", "extra"), [("Llama", {}), ("Mistral", {"sliding_window": 16}), ("Qwen2", {})])
def test_llama_mistral_and_qwen2_stages_give_transformers_logits_with_its_cache(tmp_path, family, extra):
    # Rotary embeddings from the positions, two query heads per key/value head (the cache
    # holds the two key/value heads), Mistral's sliding window (16 of the 39 positions).
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**SMALL_LLAMA, **extra)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    section = write_generation(model, tmp_path, seed=0)
    assert section["reference"]["relative_error"] <= 1e-4
    assert [s["cache"] for s in section["stages"][1:-1]] == [{"dtype": "float32", "heads": 2, "head_dim": 8, "bytes_per_token": 128}] * 2
    stages = [torch.jit.load(str(tmp_path / s["file"])).eval() for s in section["stages"]]
    reference = load_file(str(tmp_path / REFERENCE_FILE))
    ids, want = reference["input_ids"], reference["logits"]
    got = run_generation(stages, ids, 7, 48)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4
    if extra:  # the window is what makes them equal: without it, the later positions differ
        for layer in stages[1:-1]:
            layer.window = 0
        unwindowed = run_generation(stages, ids, 7, 48)
        assert ((unwindowed - want).abs().max() / want.abs().max()).item() > 1e-3


def test_generation_is_refused_for_models_it_cannot_cut(tmp_path):
    with pytest.raises(ExportError, match=r"--generation takes a causal language model of the classes GPT2LMHeadModel, "
                                          r"LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM; "
                                          r"TinyResidual is none of them; what to try: export it without --generation"):
        export_bundle(ExportOptions(source="tests.models:tiny_residual", out=tmp_path / "b", generation=True))
    assert not (tmp_path / "b").exists()
