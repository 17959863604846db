"""MapRerankSynthesizer with a scripted LLM (no model): it is kvrag.chains' map-rerank, with the
same messages and the same choice of answer; and only KVRagLLM can serve KV blocks."""

from collections.abc import Sequence
from typing import Any

import pytest
from kvrag import chains
from llama_index.core.base.llms.types import ChatMessage, CompletionResponse, LLMMetadata, MessageRole
from llama_index.core.llms import CustomLLM, MockLLM
from llama_index.core.schema import NodeWithScore, TextNode

from llama_index.llms.kvrag import KVBlockSynthesizer, MapRerankSynthesizer


def test_only_kvrag_llm_can_serve_blocks():
    with pytest.raises(TypeError, match="needs a KVRagLLM"):
        KVBlockSynthesizer(MockLLM())


class ScriptedLLM(CustomLLM):
    """Replies to each map-rerank call by the passage it was given."""

    replies: dict[str, str]

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(is_chat_model=True)

    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any):
        from llama_index.core.base.llms.types import ChatResponse

        passage = messages[-1].content.split("\n\n")[0]
        return ChatResponse(message=ChatMessage(role="assistant", content=self.replies[passage]))

    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any):
        return self.chat(messages, **kwargs)

    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        raise AssertionError("map-rerank chats")

    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any):
        raise AssertionError("map-rerank chats")


NODES = [NodeWithScore(node=TextNode(text=t)) for t in ("first passage", "second passage", "third passage")]


@pytest.mark.parametrize(
    "replies, answer",
    [
        (["one. Score: 20", "two. Score: 90", "three. Score: 50"], "two."),
        (["no score", "two. Score: 50", "three. Score: 50"], "two."),  # ties: the earlier node
        (["a", "b", "c"], "a"),  # nothing scored: the retriever's best
    ],
)
async def test_map_rerank_takes_the_best_scored_answer(replies, answer):
    llm = ScriptedLLM(replies=dict(zip(("first passage", "second passage", "third passage"), replies)))
    assert str(MapRerankSynthesizer(llm).synthesize("q?", NODES)) == answer
    assert str(await MapRerankSynthesizer(llm).asynthesize("q?", NODES)) == answer
    streamed = MapRerankSynthesizer(llm, streaming=True).synthesize("q?", NODES)
    assert list(streamed.response_gen) == [answer]



def test_the_messages_are_the_core_map_reranks():
    messages = MapRerankSynthesizer(MockLLM()).messages("Who keeps the archive?", "Agnes keeps it.")
    assert [(m.role, m.content) for m in messages] == [
        (MessageRole.SYSTEM, chains.MAP_RERANK_SYSTEM),
        (MessageRole.USER, chains.map_message("Agnes keeps it.", "Who keeps the archive?")),
    ]
