"""What the bounded chat-template render costs per chat turn (templates.py: a worker process with
a time, output and memory bound) against transformers' own `apply_chat_template` in process.

Both give the same token ids (checked here); the bounded one pays a round trip to the worker (the
messages sent as JSON, the rendered text back) and the tokenization in this process. The worker
starts once per process, while the model loads (`templates.warm`); its start is timed apart.

    PYTHONPATH=src python benchmarks/chat_template.py [--repeats 50]

The template is ChatML as SmolLM2-Instruct and Qwen ship it; the tokenizer a byte-level BPE
trained here on the built-in text (the render's cost does not depend on the vocabulary).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tokenizer(vocab_size: int = 2048):
    """(a byte-level BPE trained on the built-in text with ChatML as its chat template, the texts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from mpsconvert.infra.texts import BUILTIN

    texts = [json.loads(line)["text"] for line in BUILTIN.read_text(encoding="utf-8").splitlines() if line.strip()]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", bos_token="<|im_start|>")
    tok.chat_template = CHATML
    return tok, texts


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()

    from mpsconvert.manifests import loadable
    from mpsconvert.model import templates

    tok, texts = tokenizer()
    t0 = time.perf_counter()
    templates.warm()
    loadable.chat_ids(tok, [{"role": "user", "content": "hi"}])  # the first render waits for the worker's imports
    start = time.perf_counter() - t0
    rows = []
    for turns in (1, 8, 32):
        msgs = []
        for i in range(turns):
            msgs += [
                {"role": "user", "content": texts[i % len(texts)][:400]},
                {"role": "assistant", "content": texts[(i + 1) % len(texts)][:400]},
            ]
        msgs.append({"role": "user", "content": "And then?"})
        want = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
        assert loadable.chat_ids(tok, msgs) == want, "the bounded render must give apply_chat_template's ids"
        plain = median_ms(
            lambda: tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True), args.repeats
        )
        bounded = median_ms(lambda: loadable.chat_ids(tok, msgs), args.repeats)
        rows.append(
            {
                "turns": turns,
                "tokens": len(want),
                "apply_chat_template_ms": round(plain, 3),
                "bounded_ms": round(bounded, 3),
                "extra_ms": round(bounded - plain, 3),
                "ratio": round(bounded / plain, 2),
            }
        )
    print(json.dumps({"worker_start_s": round(start, 3), "rows": rows}, indent=1))
    templates.close()


if __name__ == "__main__":
    main()
