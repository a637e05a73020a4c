"""Benchmark workloads: lists of (prompt, prompt token ids, output length), deterministic.

text2sql   1-3 CREATE TABLE statements and a question (~140 prompt tokens), 64 output tokens
chat       short chat-templated questions; output lengths log-normal (median 100, 8..1024)
random     random token ids, --input-len / --output-len
FILE       JSONL lines {"prompt": ..., "output_len": ...} (output_len optional)

Every backend runs the same token ids for the same number of output tokens (ignore_eos).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

import numpy as np

WORKLOADS = ("text2sql", "chat", "random")
DEFAULT_OUTPUT_LEN = {"text2sql": 64, "random": 128, "dataset": 128}
CHAT_MEDIAN_OUTPUT_LEN = 100
CHAT_SIGMA = 1.0
CHAT_MIN_OUTPUT_LEN = 8
CHAT_MAX_OUTPUT_LEN = 1024


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: the text (for HTTP), its token ids (offline) and output length."""

    prompt: str
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


# ---- text2sql ------------------------------------------------------------------------------
_TABLES = {
    "customers": [
        "customer_id",
        "first_name",
        "last_name",
        "email",
        "city",
        "country",
        "signup_date",
    ],
    "orders": ["order_id", "customer_id", "order_date", "status", "total_amount", "shipping_city"],
    "products": [
        "product_id",
        "product_name",
        "category",
        "unit_price",
        "stock_quantity",
        "supplier_id",
    ],
    "employees": ["employee_id", "full_name", "department", "salary", "hire_date", "manager_id"],
    "departments": ["department_id", "department_name", "budget", "location"],
    "students": ["student_id", "student_name", "major", "enrollment_year", "gpa"],
    "courses": ["course_id", "course_title", "credits", "instructor", "semester"],
    "enrollments": ["enrollment_id", "student_id", "course_id", "grade", "enrolled_on"],
    "flights": [
        "flight_id",
        "airline",
        "origin_airport",
        "destination_airport",
        "departure_time",
        "delay_minutes",
    ],
    "airports": ["airport_code", "airport_name", "city", "country", "elevation_ft"],
    "patients": ["patient_id", "patient_name", "birth_date", "blood_type", "insurance_plan"],
    "visits": ["visit_id", "patient_id", "doctor_name", "visit_date", "diagnosis", "cost"],
    "songs": ["song_id", "title", "artist_name", "genre", "duration_seconds", "release_year"],
    "playlists": ["playlist_id", "playlist_name", "owner_id", "created_at", "num_followers"],
    "stores": ["store_id", "store_name", "region", "opened_on", "floor_area_m2"],
    "sales": ["sale_id", "store_id", "product_id", "sale_date", "quantity", "revenue"],
}
_REFERENCED = {columns[0]: table for table, columns in _TABLES.items()}
_NUMERIC_HINTS = (
    "amount",
    "price",
    "quantity",
    "salary",
    "budget",
    "credits",
    "gpa",
    "minutes",
    "ft",
    "cost",
    "seconds",
    "year",
    "followers",
    "m2",
    "revenue",
)
_QUESTIONS = [
    "What is the average {num} of {table} for each {text}?",
    "How many {table} have a {num} greater than 100?",
    "List the {text} of the 10 {table} with the highest {num}.",
    "Which {text} has the largest total {num} in {table}?",
    "Show every {text} in {table} together with the number of rows for it, sorted by that count.",
    "Find the {table} whose {num} is below the overall average {num}.",
    "For each {text}, what are the minimum and maximum {num} in {table}?",
]


def _column_type(name: str) -> str:
    if name.endswith("_id"):
        return "INTEGER"
    if name.endswith(("_date", "_time", "_on", "_at")):
        return "DATE"
    if name.endswith(_NUMERIC_HINTS) or name in ("gpa", "budget", "salary", "credits", "cost"):
        return "REAL"
    return "TEXT"


def _create_table(rng: random.Random, table: str) -> tuple[str, list[str]]:
    columns = _TABLES[table]
    keep = [columns[0]] + sorted(
        rng.sample(columns[1:], k=rng.randint(3, len(columns) - 1)), key=columns.index
    )
    lines = [f"  {keep[0]} {_column_type(keep[0])} PRIMARY KEY"]
    lines += [f"  {c} {_column_type(c)}" for c in keep[1:]]
    lines += [
        f"  FOREIGN KEY ({c}) REFERENCES {_REFERENCED[c]}({c})"
        for c in keep[1:]
        if c in _REFERENCED and _REFERENCED[c] != table
    ]
    return f"CREATE TABLE {table} (\n" + ",\n".join(lines) + "\n);", keep


def text2sql_prompt(rng: random.Random) -> str:
    """One prompt: a schema of 1-3 tables, a question about the first, and "SELECT"."""
    tables = rng.sample(sorted(_TABLES), k=rng.randint(1, 3))
    statements, first_columns = [], []
    for i, table in enumerate(tables):
        ddl, columns = _create_table(rng, table)
        statements.append(ddl)
        if i == 0:
            first_columns = columns
    numeric = [c for c in first_columns if _column_type(c) == "REAL"] or first_columns[:1]
    text = [c for c in first_columns if _column_type(c) in ("TEXT", "DATE")] or first_columns[1:2]
    question = rng.choice(_QUESTIONS).format(
        table=tables[0], num=rng.choice(numeric), text=rng.choice(text)
    )
    return (
        "-- Given this SQLite schema, write a query that answers the question.\n"
        + "\n".join(statements)
        + f"\n-- Question: {question}\n"
        "-- Answer with a single SQL query, without any explanation.\nSELECT"
    )


# ---- chat -----------------------------------------------------------------------------------
_CHAT_TOPICS = [
    "the French Revolution",
    "black holes",
    "sourdough bread",
    "the TCP handshake",
    "photosynthesis",
    "compound interest",
    "the Roman Empire",
    "Python decorators",
    "jet lag",
    "the offside rule in football",
    "volcanoes",
    "vaccines",
    "chess openings",
    "the stock market",
    "climate change",
    "binary search",
    "the Moon landing",
    "coffee",
]
_CHAT_ASKS = [
    "Explain {} in simple terms.",
    "Give me three fun facts about {}.",
    "Write a short poem about {}.",
    "What are common misconceptions about {}?",
    "Summarize the history of {}.",
    "How would you teach {} to a child?",
    "List pros and cons of learning about {}.",
    "Tell me a story involving {}.",
]


def chat_output_lens(num: int, seed: int) -> list[int]:
    """Heavy-tailed output lengths: log-normal, median 100 tokens, clipped to [8, 1024]."""
    rng = np.random.default_rng(seed)
    lens = rng.lognormal(mean=math.log(CHAT_MEDIAN_OUTPUT_LEN), sigma=CHAT_SIGMA, size=num)
    return np.clip(np.rint(lens), CHAT_MIN_OUTPUT_LEN, CHAT_MAX_OUTPUT_LEN).astype(int).tolist()


def _chat_text(tokenizer, question: str) -> str:
    messages = [{"role": "user", "content": question}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return f"User: {question}\nAssistant:"


# ---- builders -------------------------------------------------------------------------------
def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=True)  # as LLMEngine.tokenize does


def text2sql_requests(tokenizer, num: int, seed: int, output_len: int | None) -> list[BenchRequest]:
    rng = random.Random(seed)
    out_len = output_len or DEFAULT_OUTPUT_LEN["text2sql"]
    prompts = [text2sql_prompt(rng) for _ in range(num)]
    return [BenchRequest(p, _encode(tokenizer, p), out_len) for p in prompts]


def chat_requests(tokenizer, num: int, seed: int, output_len: int | None) -> list[BenchRequest]:
    rng = random.Random(seed)
    lens = [output_len] * num if output_len else chat_output_lens(num, seed)
    questions = [rng.choice(_CHAT_ASKS).format(rng.choice(_CHAT_TOPICS)) for _ in range(num)]
    texts = [_chat_text(tokenizer, q) for q in questions]
    return [BenchRequest(t, _encode(tokenizer, t), n) for t, n in zip(texts, lens)]


def random_requests(
    tokenizer, num: int, seed: int, input_len: int, output_len: int | None
) -> list[BenchRequest]:
    """Random ordinary (non-special) tokens, decoded to text and cut to ``input_len`` ids."""
    if input_len < 1:
        raise ValueError(f"--input-len must be >= 1, got {input_len}")
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    requests = []
    for _ in range(num):
        text = tokenizer.decode([rng.choice(vocab) for _ in range(input_len)])
        ids = _encode(tokenizer, text)[:input_len]
        requests.append(
            BenchRequest(tokenizer.decode(ids), ids, output_len or DEFAULT_OUTPUT_LEN["random"])
        )
    return requests


def dataset_requests(
    tokenizer, path: str, num: int | None, output_len: int | None
) -> list[BenchRequest]:
    """JSONL: one object per line with "prompt" and optional "output_len"; first ``num`` lines."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                raise ValueError(f'{path}:{line_no}: expected an object with a string "prompt"')
            n = output_len or int(item.get("output_len") or DEFAULT_OUTPUT_LEN["dataset"])
            requests.append(BenchRequest(item["prompt"], _encode(tokenizer, item["prompt"]), n))
            if num is not None and len(requests) == num:
                break
    if not requests:
        raise ValueError(f"{path} holds no prompts")
    return requests


def make_requests(
    tokenizer,
    workload: str,
    num_prompts: int,
    seed: int = 0,
    output_len: int | None = None,
    input_len: int = 128,
    dataset: str | None = None,
) -> list[BenchRequest]:
    """The requests of a workload (``dataset`` set: read the JSONL file instead)."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if output_len is not None and output_len < 1:
        raise ValueError(f"--output-len must be >= 1, got {output_len}")
    if dataset:
        return dataset_requests(tokenizer, dataset, num_prompts, output_len)
    if workload == "text2sql":
        return text2sql_requests(tokenizer, num_prompts, seed, output_len)
    if workload == "chat":
        return chat_requests(tokenizer, num_prompts, seed, output_len)
    if workload == "random":
        return random_requests(tokenizer, num_prompts, seed, input_len, output_len)
    raise ValueError(
        f"unknown workload {workload!r}; choose one of {list(WORKLOADS)} or --dataset FILE"
    )
