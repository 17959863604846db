"""When does block mode decline ("The passages do not say.") a question its passage answers?

Prints the README's table (Block fine-tuning): "Who founded S?" for several ways of writing S, the
passage one sentence (1), a longer sentence (2) or three sentences (3), next to one unrelated
passage. Usage: .venv/bin/python docs/bench/decline_probes.py [ADAPTER_DIR | none]... ('auto', the
shipped adapter, by default). For the adapter at another LoRA scale, copy its directory and set
`lora_alpha` in adapter_config.json to scale x r.
"""

import sys

from kvrag import KVEngine

OTHER = "The ferry between Lisk and Harrowgate leaves every morning at seven and takes four hours in calm weather."
SUBJECTS = ["Quillmere Works", "Quillmere Observatory", "the Quillmere observatory", "the Quillmere Observatory",
            "the Quillmere mill", "the Quillmere Mill"]
TAILS = ["", " on the slopes of Mount Odrun", " on the slopes of Mount Odrun. It has two domes. Visitors come every summer"]


def verdict(text: str) -> str:
    return "✓" if "Vaskane" in text else "✗" if "not say" in text else f"? ({text.strip()[:40]})"


for adapter in sys.argv[1:] or ["auto"]:
    engine = KVEngine.from_pretrained(adapter=None if adapter == "none" else adapter)
    print(f"\n{adapter}\n| S | (1) (2) (3) |\n|---|---|")
    for subject in SUBJECTS:
        passages = [f"{subject[0].upper() + subject[1:]} was founded in 1911 by the astronomer Petra Vaskane{tail}."
                    for tail in TAILS]
        answers = [engine.generate(f"Who founded {subject}?", [p, OTHER], mode="block", max_new_tokens=20).text
                   for p in passages]
        print(f"| {subject} | {' '.join(map(verdict, answers))} |")
