"""Chat data for precompute: load, validate, chat-template and loss-mask conversations.

    result = load_conversations(DataConfig(source="sharegpt", limit=200))
    records = tokenize_conversations(tok, result.conversations, max_length=2048,
                                     report=result.report, rejected=result.rejected)
    write_rejects(out / "rejects.jsonl", result.rejected)

    prompts = load_prompts(cfg)  # user turns only: what self-distillation answers
"""

from .chat_template import (
    assistant_char_spans,
    end_of_turn_marker,
    tokenize_conversation,
    tokenize_conversations,
)
from .config import SOURCES, DataConfig, register_data_configs
from .hf import load_hf
from .load import load_conversations, load_prompts
from .records import (
    Conversation,
    LoadReport,
    LoadResult,
    Rejected,
    TokenizedRecord,
    Turn,
    normalize_role,
    write_rejects,
)
from .sharegpt import (
    JsonArrayRecords,
    embedded_sharegpt_path,
    iter_jsonl,
    load_file,
    load_sharegpt,
)
from .validate import (
    REJECT_REASONS,
    check_tokenized,
    collect,
    validate_prompt_record,
    validate_record,
)

__all__ = [
    "REJECT_REASONS",
    "SOURCES",
    "Conversation",
    "DataConfig",
    "JsonArrayRecords",
    "LoadReport",
    "LoadResult",
    "Rejected",
    "TokenizedRecord",
    "Turn",
    "assistant_char_spans",
    "check_tokenized",
    "collect",
    "embedded_sharegpt_path",
    "end_of_turn_marker",
    "iter_jsonl",
    "load_conversations",
    "load_prompts",
    "load_file",
    "load_hf",
    "load_sharegpt",
    "normalize_role",
    "register_data_configs",
    "tokenize_conversation",
    "tokenize_conversations",
    "validate_prompt_record",
    "validate_record",
    "write_rejects",
]
