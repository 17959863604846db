"""The LlamaIndex layouts of `kvrag bench accuracy --prompts` are the prompts LlamaIndex sends:
rendered by kvrag.eval.layouts and by LlamaIndex's own templates through KVRagLLM, the text is the same."""

import pytest
from kvrag.eval.layouts import LAYOUTS

from llama_index.core import get_response_synthesizer
from llama_index.core.prompts.chat_prompts import CHAT_TEXT_QA_PROMPT
from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT

pytestmark = pytest.mark.e2e  # the real default model's chat template (conftest's engine)

QUESTION = "Who keeps the ledger?"
PASSAGES = ["The harbour master keeps the ledger.", "Ships arrive on the third day.", "The lighthouse is white."]


def test_the_text_qa_layouts_render_as_llamaindex_sends_them(llm, engine):
    context = "\n\n".join(PASSAGES)  # how LlamaIndex's synthesizers join retrieved chunks
    chat = llm.render(CHAT_TEXT_QA_PROMPT.format_messages(context_str=context, query_str=QUESTION))[0]
    assert LAYOUTS["llamaindex-chat-qa"].render(engine, QUESTION, PASSAGES)[0] == chat
    completion = llm._render_completion(DEFAULT_TEXT_QA_PROMPT.format(context_str=context, query_str=QUESTION), False)[0]
    assert LAYOUTS["llamaindex-text-qa"].render(engine, QUESTION, PASSAGES)[0] == completion


def test_a_query_engine_asks_kvragllm_in_the_chat_layout(llm):
    """KVRagLLM is a chat model, so the built-in synthesizers pick CHAT_TEXT_QA_PROMPT for it."""
    synthesizer = get_response_synthesizer(llm=llm, response_mode="compact")
    chosen = synthesizer.get_prompts()["text_qa_template"].select(llm)
    assert chosen.message_templates == CHAT_TEXT_QA_PROMPT.message_templates
