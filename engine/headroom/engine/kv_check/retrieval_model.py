"""A small Llama that can retrieve, trained here on the CPU: the model `kv-check`'s tests and
`bench/kv_quant_quality.py` run, because a random model retrieves nothing.

The task is associative recall in the needle's own words (`needle.NEEDLE`, `needle.QUESTION`):
facts "the pass key for KEY is VALUE ." scattered through filler, then questions about each,
answered by the value. The filler is a Markov chain over pseudo-words (each word has four
likely successors), so next-token predictions on the filler are confident and top-1 agreement
between two KV dtypes means something. Vocabulary: one word per token (a `tokenizers`
WordLevel model, lower-cased) except that "KEY is" is one token, as a BPE merge would make
it, so the answer is the token after the one the question ends with; written as
`tokenizer.json` for the engine.

Architecture: Llama, 2 layers, hidden 128, 2 heads of 64 (the CUDA kernels' head size),
RoPE theta 1e6, so the rotary pairs a content match uses turn less than 0.03 rad over 16k
tokens. The mechanics of the lookup are built in before training (`warm_start`): what to
look up is learnt (600 steps of 16 sequences growing from 96 to 768 tokens, about 5 minutes
on a busy 2-core machine). It then answers 100 % of needles up to 4k tokens, 95 % at 8k and
about half at 16k, longer than anything it was trained on.

Training is deterministic (fixed seeds, one thread, `torch.use_deterministic_algorithms`):
the same code and config give the same weights, cached under
`$HEADROOM_CACHE/models/retrieval-<digest>` (digest of this file, the needle module and the
config). It needs `transformers` (the dev extra): `LlamaForCausalLM` trains it and writes
the Hugging Face checkpoint the engine's loader reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from headroom.engine.kv_check import needle

SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")
PAD, UNK, BOS, EOS = range(4)
_TEMPLATE_WORDS = ("the", "pass", "key", "for", "is", ".", "what", "?")
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """The architecture and the training schedule (part of the cache key)."""

    hidden: int = 128
    intermediate: int = 384
    layers: int = 2
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 1e6
    max_positions: int = 32768
    filler_words: int = 256
    steps: int = 600
    batch: int = 16
    min_len: int = 96
    max_len: int = 768
    lr: float = 3e-3
    warmup: int = 20
    answer_weight: float = 4.0
    seed: int = 0


def filler_words(n: int) -> list[str]:
    """`n` distinct two-syllable pseudo-words ("bako", "timu", ...), a fixed list."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    rng = random.Random(1234)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n:
        w = rng.choice(syllables) + rng.choice(syllables)
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def key_is(key: str) -> str:
    """The merged token of "KEY is" (see `write_tokenizer`)."""
    return f"{key} is"


def vocabulary(cfg: TrainConfig) -> list[str]:
    """Token strings in id order: specials, template words, keys, "KEY is", values, filler."""
    words = [*SPECIALS, *_TEMPLATE_WORDS, *needle.KEYS, *map(key_is, needle.KEYS)]
    words += [*needle.VALUES, *filler_words(cfg.filler_words)]
    assert len(set(words)) == len(words), "vocabulary words must be distinct"
    return words


class Language:
    """Token ids of the task's pieces and seeded generators of filler, facts and questions."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.words = vocabulary(cfg)
        ids = {w: i for i, w in enumerate(self.words)}
        self.ids = ids
        self.keys = [ids[k] for k in needle.KEYS]
        self.key_is = {ids[k]: ids[key_is(k)] for k in needle.KEYS}
        self.values = [ids[v] for v in needle.VALUES]
        self.filler = [ids[w] for w in filler_words(cfg.filler_words)]
        self.period = ids["."]
        rng = random.Random(cfg.seed + 7)
        # Each filler word's four likely successors, most likely first; "." ends sentences.
        self.successors = {w: rng.sample(self.filler, 4) for w in self.filler}

    def fact(self, key: int, value: int) -> list[int]:
        w = self.ids
        return [w["the"], w["pass"], w["key"], w["for"], self.key_is[key], value, w["."]]

    def question(self, key: int) -> list[int]:
        w = self.ids
        ask = [w["what"], w["is"], w["the"], w["pass"], w["key"], w["for"], key, w["?"]]
        return [*ask, w["the"], w["pass"], w["key"], w["for"], self.key_is[key]]

    def filler_text(self, n: int, rng: random.Random) -> list[int]:
        """`n` tokens of the Markov filler (sentences of 6-16 words)."""
        out: list[int] = []
        word = rng.choice(self.filler)
        left = rng.randint(6, 16)
        while len(out) < n:
            if left == 0:
                out.append(self.period)
                word, left = rng.choice(self.filler), rng.randint(6, 16)
                continue
            out.append(word)
            left -= 1
            r = rng.random()
            succ = self.successors[word]
            word = succ[0] if r < 0.55 else succ[1] if r < 0.8 else succ[2] if r < 0.92 else succ[3]
        return out[:n]

    def sample(self, length: int, rng: random.Random) -> tuple[list[int], list[int]]:
        """One training sequence of `length` tokens and the positions of its answer tokens
        (the value after each question)."""
        # A fact, its question and answer take 22 tokens: up to 60 % of the sequence, 12 at most.
        n_facts = rng.randint(1, max(1, min(12, (length * 6 // 10) // 24)))
        keys = rng.sample(self.keys, n_facts)
        facts = [(k, rng.choice(self.values)) for k in keys]
        asked = rng.sample(facts, n_facts)  # all of them, in another order
        tail: list[int] = []
        answers: list[int] = []
        for k, v in asked:
            tail += self.question(k)
            answers.append(len(tail))
            tail += [v, self.period]
        body_len = length - 1 - len(tail) - sum(len(self.fact(k, v)) for k, v in facts)
        body = self.filler_text(max(body_len, 0), rng)
        # Facts at random depths of the body, in order.
        cuts = sorted(rng.randint(0, len(body)) for _ in facts)
        seq = [BOS]
        prev = 0
        for cut, (k, v) in zip(cuts, facts, strict=True):
            seq += body[prev:cut] + self.fact(k, v)
            prev = cut
        seq += body[prev:]
        offset = len(seq)
        seq += tail
        return seq[:length], [offset + a for a in answers if offset + a < length]


def cache_root() -> Path:
    root = os.environ.get("HEADROOM_CACHE") or str(Path.home() / ".cache" / "headroom")
    return Path(root) / "models"


def digest(cfg: TrainConfig) -> str:
    """What the weights depend on: this file, the needle module and the config."""
    h = hashlib.sha256()
    for mod in (sys.modules[__name__], needle):
        assert mod.__file__ is not None
        h.update(Path(mod.__file__).read_bytes())
    h.update(json.dumps(asdict(cfg), sort_keys=True).encode())
    return h.hexdigest()[:16]


def write_tokenizer(path: Path, cfg: TrainConfig) -> None:
    """`tokenizer.json`: one token per word, lower-cased, `<s>` prepended on request."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    vocab = {w: i for i, w in enumerate(vocabulary(cfg))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    # Words and punctuation as `Whitespace` splits them, except that "KEY is" is one token.
    keys = "|".join(needle.KEYS)
    tok.pre_tokenizer = pre_tokenizers.Split(
        Regex(rf"(?:{keys}) is\b|\w+|[^\w\s]+"), behavior="removed", invert=True
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS)]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(path / "tokenizer.json"))


def write_documents(path: Path, lang: Language, n: int = 16, words: int = 6000) -> None:
    """`documents.jsonl`: filler documents in the model's language, the `--prompts` of tests."""
    rng = random.Random(99)
    with (path / "documents.jsonl").open("w") as f:
        for _ in range(n):
            text = " ".join(lang.words[t] for t in lang.filler_text(words, rng))
            f.write(json.dumps({"text": text}) + "\n")


Progress = Callable[[int, int, float, float], None]


def train(cfg: TrainConfig, out: Path, progress: Progress | None = None) -> Path:
    """Train the model and write a Hugging Face directory at `out` (config.json,
    model.safetensors, tokenizer.json, documents.jsonl, train.json)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    lang = Language(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(cfg.seed)
        hf_cfg = LlamaConfig(
            vocab_size=len(lang.words),
            hidden_size=cfg.hidden,
            intermediate_size=cfg.intermediate,
            num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads,
            num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_positions,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
            bos_token_id=BOS,
            eos_token_id=EOS,
            pad_token_id=PAD,
            tie_word_embeddings=False,
        )
        hf_cfg.architectures = ["LlamaForCausalLM"]
        model = LlamaForCausalLM(hf_cfg)
        warm_start(model, cfg)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
        rng = random.Random(cfg.seed)
        t0 = time.monotonic()
        loss_value = 0.0
        for step, (ids, answers) in enumerate(_batches(cfg, lang, rng)):
            # Short warm-up, constant, then a linear decay over the last fifth: the lookup is
            # learnt in a sudden drop after a plateau, and a decaying rate prolongs the plateau.
            lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup, 5 * (cfg.steps - step) / cfg.steps)
            for group in opt.param_groups:
                group["lr"] = lr
            logits = model(input_ids=ids).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
            )
            answer = answers[:, 1:].reshape(-1)
            # Answers weigh a few tokens each. Weighing them as much as all other tokens
            # together drowns, after gradient clipping, the dense signal of the repeated spans
            # that teaches the lookup, and the model never leaves its plateau.
            weight = 1.0 + (cfg.answer_weight - 1.0) * answer.float()
            loss = (nll * weight).sum() / weight.sum()
            hit = float((logits.reshape(-1, logits.shape[-1])[answer].argmax(-1)
                         == ids[:, 1:].reshape(-1)[answer]).float().mean())  # fmt: skip
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss_value = float(loss.detach())
            if progress is not None and (step % 50 == 0 or step == cfg.steps - 1):
                progress(step + 1, cfg.steps, loss_value, hit)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out), safe_serialization=True)
        write_tokenizer(out, cfg)
        write_documents(out, lang)
        meta = {"config": asdict(cfg), "final_loss": loss_value, "seconds": time.monotonic() - t0}
        (out / "train.json").write_text(json.dumps(meta, indent=2) + "\n")
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)
    return out


def warm_start(model: object, cfg: TrainConfig) -> None:
    """Build the mechanics of a lookup into the fresh model; training learns what to look up.

    Looking a fact up takes two heads in a row: one copies each token's predecessor into its
    position; the next matches the question's last token against those copies and copies out
    the token found. Gradient descent finds that pair only after a plateau that took small
    models tens of millions of tokens: runs of 1,000 steps here never left it, from scratch
    or with the first head given. So the fixed parts start built and only the match is left:
    - the embeddings hold content in dimensions 0..63 (std 0.1) and a constant channel (the
      last dimension), and leave 64..126 empty;
    - layer 0, head 0: query and key read only the constant channel and are rotated against
      each other by one position's RoPE angle in every rotary pair that turns at least 0.04
      rad per token, so the score peaks at the previous token (99.9 % of the attention even
      over 16k tokens); value and output copy that token's content into 64..126;
    - layer 1, head 0: value and output copy the attended token's content into 0..63, and
      the LM head starts as the embeddings' content, so whatever that head attends to is
      predicted. Its query and key start random: which position to attend to (the one whose
      predecessor is the question's last token) is what training has to find.
    Every weight, these included, is then trained."""
    import torch

    m = model.model  # type: ignore[attr-defined]
    d, c = cfg.head_dim, cfg.hidden - 1
    assert cfg.kv_heads == cfg.heads and 2 * d == cfg.hidden, "the layout below assumes these"
    theta = cfg.rope_theta ** (-2 * torch.arange(d // 2, dtype=torch.float64) / d)
    pairs = [i for i in range(d // 2) if theta[i] >= 0.04]
    amp = 80.0**0.5  # per pair, q.k = 80: a score gap of 8 after the 1/sqrt(64) scaling
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    with torch.no_grad():
        emb = m.embed_tokens.weight
        emb.zero_()
        emb[:, :d] = torch.randn(emb.shape[0], d, generator=gen) * 0.1
        emb[:, c] = 1.0
        x_c = 1.0 / float(emb.pow(2).mean(-1).sqrt().mean())  # the channel after RMSNorm
        prev = m.layers[0].self_attn
        for w in (prev.q_proj.weight, prev.k_proj.weight, prev.v_proj.weight):
            w[:d] = 0.0
        prev.o_proj.weight[:, :d] = 0.0
        for i in pairs:
            prev.q_proj.weight[i, c] = amp / x_c
            prev.k_proj.weight[i, c] = amp * float(torch.cos(theta[i])) / x_c
            prev.k_proj.weight[i + d // 2, c] = amp * float(torch.sin(theta[i])) / x_c
        prev.v_proj.weight[:d, :d] = torch.eye(d)
        prev.o_proj.weight[d : 2 * d - 1, : d - 1] = 0.15 * torch.eye(d - 1)
        look = m.layers[1].self_attn
        look.v_proj.weight[:d] = 0.0
        look.v_proj.weight[:d, :d] = torch.eye(d)
        look.o_proj.weight[:, :d] = 0.0
        look.o_proj.weight[:d, :d] = 0.2 * torch.eye(d)
        head = model.lm_head.weight  # type: ignore[attr-defined]
        head.zero_()
        head[:, :d] = emb[:, :d]


def _batches(cfg: TrainConfig, lang: Language, rng: random.Random) -> Iterator[tuple]:  # type: ignore[type-arg]
    """(ids `[batch, L]`, answer mask `[batch, L]`) per step; L grows from min_len to max_len
    over the first half of training (short contexts teach the lookup fast)."""
    import torch

    for step in range(cfg.steps):
        frac = min(1.0, step / max(1, cfg.steps // 2))
        hi = int(cfg.min_len + frac * (cfg.max_len - cfg.min_len))
        length = rng.randint(cfg.min_len, max(cfg.min_len, hi))
        ids = torch.empty(cfg.batch, length, dtype=torch.long)
        answers = torch.zeros(cfg.batch, length, dtype=torch.bool)
        for b in range(cfg.batch):
            seq, where = lang.sample(length, rng)
            ids[b] = torch.tensor(seq)
            answers[b, where] = True
        yield ids, answers


def ensure_model(
    cfg: TrainConfig | None = None, root: Path | None = None, progress: Progress | None = None
) -> Path:
    """The trained model's directory, training it first when the cache lacks it."""
    cfg = cfg or TrainConfig()
    path = (root or cache_root()) / f"retrieval-{digest(cfg)}"
    if (path / "model.safetensors").is_file() and (path / "train.json").is_file():
        return path
    if path.exists():
        # Damaged from outside (train.json lost): entries appear whole, by the rename below,
        # which cannot land on a directory that is not empty.
        shutil.rmtree(path, ignore_errors=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    train(cfg, tmp, progress)
    try:
        tmp.rename(path)  # atomic: a concurrent builder never sees half a directory
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (path / "train.json").is_file():
            raise
    return path


def main() -> int:
    """`python -m headroom.engine.kv_check.retrieval_model`: build (or find) the model."""

    def show(step: int, total: int, loss: float, hit: float) -> None:
        print(f"step {step}/{total} loss {loss:.3f} answers {hit:.0%}", file=sys.stderr)

    print(ensure_model(progress=show))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
