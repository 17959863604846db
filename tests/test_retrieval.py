"""The one Chroma set-up (CLI, LangChain, LlamaIndex) and the CLI's passage index, with a fake embedder."""

from kvrag.app.retrieval import COSINE, PassageIndex, chroma_collection, chroma_path, passage_id


class LengthEmbedder:
    """Unit vectors from the text's length: enough to tell three passages apart, no model."""

    def embed(self, texts):
        return [[1.0, 0.0] if len(t) < 20 else [0.0, 1.0] if len(t) < 40 else [0.6, 0.8] for t in texts]


def test_collections_are_cosine_and_take_the_vectors_they_are_given(tmp_path):
    collection = chroma_collection(tmp_path, "notes")
    assert collection.configuration_json["hnsw"]["space"] == COSINE["hnsw:space"] == "cosine"
    collection.upsert(ids=["a"], documents=["x"], embeddings=[[1.0, 0.0]])
    assert chroma_collection(tmp_path, "notes").count() == 1  # reopened, in the same process


def test_the_default_directory_is_under_kvrag_home(monkeypatch, tmp_path):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    assert chroma_path() == tmp_path / "chroma"
    assert chroma_path("llamaindex") == tmp_path / "llamaindex" / "chroma"


def test_passage_index_adds_once_per_text_and_finds_the_nearest(tmp_path):
    index = PassageIndex(tmp_path, embedder=LengthEmbedder())
    assert len(index) == 0 and index.search("anything") == []
    passages = ["short one", "a passage of middle length", "a much longer passage than the other two are"]
    index.add(passages, ["a.md", "a.md", "b.md"])
    index.add(passages[:1], ["a.md"])  # ids are content hashes: the same text is stored once
    assert len(index) == 3
    assert index.search("tiny", k=1) == ["short one"]
    assert index.search("x" * 30, k=2)[0] == passages[1]
    assert len(index.search("tiny", k=10)) == 3
    found = index.collection.get(ids=[passage_id(passages[2])])
    assert found["documents"] == [passages[2]] and found["metadatas"] == [{"source": "b.md"}]


def test_passage_index_stores_a_text_repeated_in_one_batch_once(tmp_path):
    index = PassageIndex(tmp_path, embedder=LengthEmbedder())
    index.add(["same paragraph", "other", "same paragraph"], ["a.md", "a.md", "b.md"])
    assert len(index) == 2
    assert index.collection.get(ids=[passage_id("same paragraph")])["metadatas"] == [{"source": "b.md"}]
    index.add([], [])
    assert len(index) == 2
