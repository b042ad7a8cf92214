"""Head checkpoint formats: ours (`specheads`), and the exporters and importers of the formats
serving engines load: speculators (vLLM), EAGLE-3 (SGLang, TensorRT-LLM, vLLM), EAGLE-1
(EAGLE, SGLang) and a DeepSeek-style MTP layer stitched into the target checkpoint.
`registry` lists them and dispatches; training and evaluation load heads through
`heads.checkpoint`; the CLI is `python -m train.export`."""
from heads.formats.registry import (FORMATS, detect_format, export_head, foreign_head_config,
                                    formats_for, import_head, read_foreign)

__all__ = ["FORMATS", "detect_format", "export_head", "foreign_head_config", "formats_for",
           "import_head", "read_foreign"]
