"""What a prompt asks for, by simple rules on its first user turn, so held-out ShareGPT
prompts can be scored per category (acceptance differs a lot between code, math and chat).

The rules are deliberately plain (keywords, first match wins, in the order of RULES) and
deterministic; a prompt that matches none is "chat". They label; they do not filter.
"""
from __future__ import annotations

import re

# (category, pattern) in priority order: code before writing ("write a function"), math
# before reasoning ("solve"), translation before anything language-specific.
RULES: tuple[tuple[str, str], ...] = (
    ("code", r"```|\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|html|css|"
             r"react|node\.?js|django|flask|pandas|numpy|regex|api|function|class|method|"
             r"script|code|program|compile|bug|error|debug|algorithm|json|yaml|docker|git|"
             r"linux|bash|kotlin|swift|php|ruby)\b"),
    ("math", r"\b(calculate|equation|integral|derivative|probability|algebra|geometry|"
             r"theorem|prove|sum of|solve for|percent|arithmetic|matrix|statistics|"
             r"how many|what is \d)\b"),
    ("translation", r"\b(translate|translation|in (english|french|spanish|german|chinese|"
                    r"korean|japanese))\b"),
    ("summarization", r"\b(summari[sz]e|summary|tl;?dr|key points|shorten|condense)\b"),
    ("roleplay", r"\b(act as|pretend|role[- ]?play|you are a|imagine you are|from now on)\b"),
    ("writing", r"\b(write|draft|compose|rewrite|poem|story|essay|blog|article|email|letter|"
                r"lyrics|script for|caption|slogan|headline|tweet|paragraph)\b"),
    ("business", r"\b(marketing|business|startup|customer|sales|product|brand|strategy|"
                 r"company|revenue|seo|campaign|pricing|investor)\b"),
    ("reasoning", r"\b(why|explain|compare|difference between|pros and cons|should i|"
                  r"what would happen|analy[sz]e|reason|logic|riddle|puzzle)\b"),
    ("knowledge", r"^(what|who|when|where|which|how does|how do|how is|is it true|tell me about)"),
)
CATEGORIES = tuple(c for c, _ in RULES) + ("multilingual", "chat")
_COMPILED = tuple((c, re.compile(p, re.IGNORECASE)) for c, p in RULES)


def categorize(text: str) -> str:
    """The category of a prompt's first user turn (one of CATEGORIES)."""
    head = text.strip()[:600]
    letters = [ch for ch in head if ch.isalpha()]
    if letters and sum(ch.isascii() for ch in letters) / len(letters) < 0.5:
        return "multilingual"  # mostly non-Latin script: Korean, Chinese, Japanese, ...
    for category, rx in _COMPILED:
        if rx.search(head):
            return category
    return "chat"
