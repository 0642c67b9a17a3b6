"""A varied text corpus for comparing tokenizers: code, prose, other scripts, emoji, whitespace runs, digits and
apostrophes. Deterministic: the repository's own source and README, written snippets, and seeded mixtures."""

from __future__ import annotations

import random
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPTS = [
    "我想在苹果公司工作，今天天气很好。机器学习模型的推理速度很重要。",
    "日本語のテキストも試します。東京は大きな都市です、ひらがなとカタカナ。",
    "한국어 문장도 포함합니다. 서울은 아름다운 도시입니다.",
    "مرحبا بالعالم، هذا اختبار للنص العربي مع الأرقام ١٢٣٤٥٦.",
    "שלום עולם, זהו מבחן של טקסט עברי.",
    "नमस्ते दुनिया, यह हिंदी पाठ का परीक्षण है। संख्या ४२ है।",
    "Привет, мир! Это проверка кириллицы: ёжик, съешь ещё этих булок.",
    "Γειά σου Κόσμε, αυτή είναι μια δοκιμή ελληνικών.",
    "สวัสดีชาวโลก นี่คือการทดสอบภาษาไทย",
    "Tiếng Việt có nhiều dấu: Người ta nói rằng điều đó đúng.",
    "Ünïcödé façade naïve café résumé coöperate Straße Ærø øre",
    "İstanbul'da çok güzel bir gün, ığdır şehri.",
    "emoji: 😀 🎉 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷 ❤️ 🦙🦙 ✅ 😶‍🌫️",
    "combining: e\u0301 a\u0308 n\u0303 o\u0302\u0323 and precomposed é ä ñ ộ",
    "spaces:\u00a0nbsp\u3000ideographic\u2009thin\u200bzero-width\u200dzwj\u200fRTL-mark",
    "math ∑∫√∞≠≤≥ ∀x∈ℝ: x² ≥ 0, α+β=γ, ½ ¾ ⅓",
]
PIECES = [
    " ",
    "  ",
    "    ",
    "\t",
    "\t\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n ",
    "   \n\n   ",
    "it's",
    "DON'T",
    "we'Ve",
    "'s",
    "'ll",
    "I'M",
    "''''",
    "0",
    "7",
    "42",
    "123",
    "2024",
    "3.14159",
    "1,234,567",
    "0x1F",
    "......",
    "!!!???",
    "```",
    "-----=====",
    '"""',
    "https://example.com/a/b?c=1&d=2",
    '{"key": [1, 2.5, null]}',
    "snake_case",
    "CamelCaseWord",
    "ALLCAPS",
    "word",
    "Hello",
    "the",
    "tokenizer",
    "<0x41>",
    "<unk>",
    "[INST]",
    "<start_of_turn>",
    "<|im_end|>",
    "\u2581",
]


def _source_lines(limit: int) -> list[str]:
    """Lines of the repository's own Python source and README: code with its indentation, and prose."""
    files = sorted((REPO / "models").glob("*.py")) + sorted((REPO / "engine").glob("*.py")) + [REPO / "README.md"]
    lines = []
    for f in files:
        lines += [line for line in f.read_text().splitlines() if line.strip()]
    step = max(1, len(lines) // limit)
    return lines[::step][:limit]


def _random_chars(rng: random.Random, n: int) -> str:
    """Code points from many blocks (most never seen in training: byte fallback and unknown characters)."""
    blocks = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x600, 0x6FF), (0x900, 0x97F)]
    blocks += [(0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x10000, 0x1007F)]
    return "".join(chr(rng.randint(*rng.choice(blocks))) for _ in range(n))


def corpus(n_lines: int = 3000, seed: int = 0) -> list[str]:
    """`n_lines` texts and then a tenth as many multi-line chunks of them (newlines, leading whitespace)."""
    rng = random.Random(seed)
    lines = _source_lines(n_lines // 2) + SCRIPTS * 4
    while len(lines) < n_lines:
        kind = rng.random()
        if kind < 0.5:
            parts = [rng.choice(PIECES + SCRIPTS) for _ in range(rng.randint(1, 12))]
            lines.append("".join(p if rng.random() < 0.7 else " " + p for p in parts))
        elif kind < 0.8:
            lines.append(_random_chars(rng, rng.randint(1, 40)))
        else:  # a line of the source with its words' order and spacing shaken
            words = rng.choice(lines[: n_lines // 2]).split(" ")
            rng.shuffle(words)
            lines.append(rng.choice(["", " ", "\t", "  "]).join(words))
    chunks = ["\n".join(lines[i : i + rng.randint(2, 12)]) for i in range(0, n_lines, 10)]
    return lines[:n_lines] + chunks
