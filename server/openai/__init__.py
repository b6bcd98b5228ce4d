"""The OpenAI API's request pipeline: `protocol/` (pydantic request and response models),
`fields.py` and the field modules (validation of the protocol's fields), `serving_core.py`
(the one pipeline chat, completions and Responses share), `request_params.py` (SamplingParams
once per request), `prompts.py` (chat templates and tokenization), `generation.py` (engine
events to choices' text), `grammar_compile.py` (structured-output grammars compiled ahead)."""
