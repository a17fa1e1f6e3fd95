"""deltatrain.torch.install_as_fla(): code that imports fla's gated delta rule gets deltatrain's without being
edited, with fla absent (stand-in packages) and with fla installed (its module's names replaced, its other
modules kept); HF transformers' Qwen3.5 model then runs through deltatrain's kernels (counted) and matches
its own torch fallback. Each case runs in a fresh interpreter, since the hook changes the import system."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]

# Run first in every child: the interpreter sees this one's packages, and no installed fla unless asked.
PRELUDE = """
    import os, sys
    sys.path[:0] = {path!r}
    if not {keep_fla!r}:  # an installed fla (the GPU machine's) would be taken instead of the stand-in
        sys.path = [p for p in sys.path if not os.path.isdir(os.path.join(p or ".", "fla"))]
"""


def run(*pieces, path=(), keep_fla=False):
    """Runs the code pieces (each indented as it likes) in a fresh interpreter; returns what it printed."""
    prelude = PRELUDE.format(path=list(path) + sys.path, keep_fla=keep_fla)
    script = "".join(textwrap.dedent(piece) for piece in (prelude, *pieces))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


# A module as users write them: it imports fla's names at import time.
USER = """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
"""

CHECK = """
    import torch
    import deltatrain.torch as dtt
    import user
    assert user.chunk_gated_delta_rule is dtt.chunk_gated_delta_rule
    assert user.fused_recurrent_gated_delta_rule is dtt.fused_recurrent_gated_delta_rule
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.nn.functional.normalize(torch.randn(1, 70, 2, 60, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, 70, 2, 100, generator=gen)
    g, beta = -torch.rand(1, 70, 2, generator=gen) / 8, torch.rand(1, 70, 2, generator=gen)
    o, _ = user.chunk_gated_delta_rule(q, k, v, g, beta)
    want, _ = user.chunk_gated_delta_rule(q, k, v, g, beta, backend="reference")
    assert ((o - want).norm() / want.norm()).item() < 2e-4
"""


def test_without_fla_stand_in_packages_hold_deltatrain_functions(tmp_path):
    (tmp_path / "user.py").write_text(textwrap.dedent(USER))
    out = run("""
        import deltatrain.torch as dtt
        dtt.install_as_fla()
        dtt.install_as_fla()  # again: nothing more
        assert sum(type(f).__name__ == "_FlaFinder" for f in sys.meta_path) == 1
        """, CHECK, """
        import fla.ops.gated_delta_rule as module
        print(sorted(module.__all__))
        """, path=[str(tmp_path)])
    assert "chunk_gated_delta_rule" in out


def write_fake_fla(root):
    """An installed fla as far as imports go: fla.ops re-exports the package's functions (as fla's does), and
    the package has submodules of its own."""
    package = root / "fla" / "ops" / "gated_delta_rule"
    package.mkdir(parents=True)
    (root / "fla" / "__init__.py").write_text("from . import ops\n")
    (root / "fla" / "ops" / "__init__.py").write_text(
        "from .gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule\n")
    (package / "__init__.py").write_text(textwrap.dedent("""
        def chunk_gated_delta_rule(*args, **kwargs):
            raise AssertionError("fla's chunk_gated_delta_rule was called")
        fused_recurrent_gated_delta_rule = chunk_gated_delta_rule
        chunk_gdn = chunk_gated_delta_rule
        """))
    (package / "naive.py").write_text("NAIVE = 'fla.ops.gated_delta_rule.naive'\n")


@pytest.mark.parametrize("imported_first", [False, True], ids=["hook_first", "fla_imported_first"])
def test_with_fla_installed_its_names_are_replaced_and_its_other_modules_kept(tmp_path, imported_first):
    write_fake_fla(tmp_path)
    (tmp_path / "user.py").write_text(textwrap.dedent(USER))
    run(f"""
        if {imported_first!r}:
            import fla.ops.gated_delta_rule
        import deltatrain.torch as dtt
        dtt.install_as_fla()
        """, CHECK, """
        import fla.ops, fla.ops.gated_delta_rule as module
        from fla.ops.gated_delta_rule.naive import NAIVE
        assert "stand-in" not in (module.__doc__ or "") and module.__file__.startswith(sys.path[0])
        assert fla.ops.chunk_gated_delta_rule is dtt.chunk_gated_delta_rule
        assert module.chunk_gdn is dtt.chunk_gated_delta_rule
        """, path=[str(tmp_path)], keep_fla=True)


QWEN35 = """
    import collections, json, torch
    import deltatrain.torch as dtt
    from deltatrain import _deltatrain
    calls = collections.Counter()
    if {as_fla!r}:
        dtt.install_as_fla()

        class Counting:  # counts the kernels' entry points that deltatrain.torch calls
            def __getattr__(self, name):
                function = getattr(_deltatrain.gdn, name)
                def counted(*args, **kwargs):
                    calls[name] += 1
                    return function(*args, **kwargs)
                return counted

        dtt._gdn = Counting()
    from transformers import Qwen3_5TextConfig, Qwen3_5ForCausalLM  # binds fla's names (or its fallback) now
    device, dtype = {device!r}, torch.float32 if {device!r} == "cpu" else torch.bfloat16
    config = Qwen3_5TextConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=64, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim={K}, linear_value_head_dim={V},
                               layer_types=["linear_attention", "linear_attention", "full_attention"])
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).to(device, dtype).eval()
    tokens = torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        logits = model(tokens).logits.float().cpu()
        generated = model.generate(tokens[:, :40], max_new_tokens=4, do_sample=False,
                                   return_dict_in_generate=True, output_logits=True)
    torch.save(dict(logits=logits, sequences=generated.sequences.cpu(),
                    step_logits=torch.stack(generated.logits).float().cpu()), {out!r})
    print(json.dumps(dict(calls)))
"""


@pytest.mark.parametrize("K,V", [(64, 64), (96, 128)], ids=["K64_V64", "K96_V128"])
@pytest.mark.parametrize("device", DEVICES)
def test_transformers_qwen35_runs_on_deltatrain_and_matches_its_torch_fallback(tmp_path, device, K, V):
    pytest.importorskip("transformers.models.qwen3_5")
    results = {}
    for as_fla in (False, True):
        out = tmp_path / f"as_fla_{as_fla}.pt"
        printed = run(QWEN35.format(as_fla=as_fla, device=device, K=K, V=V, out=str(out)))
        results[as_fla] = torch.load(out), json.loads(printed.strip().splitlines()[-1])
    (fallback, no_calls), (ours, calls) = results[False], results[True]
    assert no_calls == {}
    # Prefill: the forward and generate's first step, one chunked call per GDN layer each; the 3 decode steps
    # after it, one recurrent call per GDN layer each.
    assert calls == {"chunk_forward": 2 * 2, "recurrent_forward": 3 * 2}, calls
    # float32 on the CPU; bfloat16 on the GPU, where each of the two GDN layers owes 1.5e-2 (tests/gdn_cuda).
    tolerance = 1e-4 if device == "cpu" else 5e-2

    def error(name, steps=slice(None)):
        a, b = ours[name][steps], fallback[name][steps]
        return ((a - b).norm() / b.norm()).item()

    print(f"Qwen3.5 {device} K={K} V={V}: kernel calls {calls}; relative error of the logits {error('logits'):.2e}, "
          f"of the first decode step's {error('step_logits', slice(0, 1)):.2e}")  # shown with pytest -s
    assert error("logits") < tolerance, error("logits")
    assert error("step_logits", slice(0, 1)) < tolerance  # the prefill's
    # Later steps decode what earlier ones chose, which in bfloat16 may differ at a near-tie.
    if device == "cpu" or torch.equal(ours["sequences"], fallback["sequences"]):
        assert torch.equal(ours["sequences"], fallback["sequences"])
        assert error("step_logits") < tolerance, error("step_logits")
