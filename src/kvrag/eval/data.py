"""A deterministic multi-document QA set about fictional people, companies, cities and works.

No real multi-document QA set with passages can be downloaded offline, and a real one would let
the model answer from memory. Here every fact is invented, so the passages are the only source.
Each entity gets one passage of 60-200 tokens: its facts in varied sentences and some colour that
states nothing. A question comes with its gold passages (one or two) and distractors, shuffled:

* ``single`` - one fact of one entity ("In which city was Ravel Osk born?");
* ``bridge`` - two hops: a fact of the entity that another entity's passage names ("In which
  country was Ravel Osk born?" needs her passage for the city and the city's for the country);
* ``comparison`` - two entities' facts compared ("Who was born earlier, A or B?");
* ``unanswerable`` - a fact the subject's passage leaves out, and no passage states.

Every answer appears in a gold passage and in no distractor; the value behind an unanswerable
question appears in no passage at all. The train, dev and test splits are separate worlds whose
names come from disjoint parts of one pool, so no entity is shared.

``prose`` rewrites a share of the passages as connected prose (several facts to a sentence,
references back, one fact outside the fourteen templates) and asks their questions in other words
too: part of the training data, and, on the test split, a held-out world of prose to evaluate on.
"""

import itertools
import random
from dataclasses import dataclass

SPLITS = ("train", "dev", "test")
QUESTION_TYPES = ("single", "bridge", "comparison", "unanswerable")
REFUSALS = (
    "unanswerable",
    "do not say",
    "does not say",
    "don't say",
    "doesn't say",
    "not mentioned",
    "not stated",
    "not specified",
    "not provided",
    "not given",
    "no information",
    "not know",
    "don't know",
    "cannot be determined",
    "unknown",
)
"""Phrases that count as declining to answer: the gold answers of an unanswerable question."""

UNANSWERABLE_TARGET = "The passages do not say."

_SCALE = {"train": 4, "dev": 1, "test": 1}  # world size per split, in units of _UNIT
_UNIT = {"person": 48, "company": 24, "city": 20, "work": 24, "country": 6, "river": 20}

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kr", "st", "th", "tr", "sh"]
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ai", "ou"]
_CODAS = ["", "", "", "", "n", "r", "l", "s", "m"]

OCCUPATIONS = ["glassblower", "cartographer", "botanist", "clockmaker", "architect", "violinist", "surveyor",
               "bookbinder", "chemist", "ferry pilot", "weaver", "astronomer", "stonemason", "translator"]
PRODUCTS = ["telescopes", "ferries", "paper", "bicycles", "pianos", "lamps", "ceramics", "maps", "rope",
            "clocks", "textiles", "radios"]
WORK_KINDS = ["novel", "film", "opera", "play", "symphony", "poem cycle"]
WORK_NOUNS = ["Letters", "Harbour", "Winter", "Lantern", "Orchard", "Crossing", "Bell", "Archive", "Tide",
              "Garden", "Mirror", "Road"]


@dataclass(frozen=True)
class QAExample:
    """One question with its passages. ``gold`` indexes the passages that answer it (for an
    unanswerable one: the subject's passage, which leaves the fact out). ``answers`` are the gold
    answers; ``wrong`` the other candidate of a comparison; ``target`` a short natural answer.
    ``preceding``: where known, the text before each passage in its document (block context "document")."""

    id: str
    split: str
    type: str
    question: str
    answers: tuple[str, ...]
    target: str
    passages: tuple[str, ...]
    gold: tuple[int, ...]
    wrong: tuple[str, ...] = ()
    preceding: tuple[str, ...] = ()


@dataclass
class _Entity:
    kind: str
    name: str
    facts: dict
    withheld: str | None = None
    passage: str = ""
    prose: bool = False  # written as connected prose (see `generate`)


# ---- names ------------------------------------------------------------------------------------------


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(2)).capitalize()


def _name_pools(seed: int) -> dict[str, list[str]]:
    """Unique invented words for every split; none is part of another, so a name never matches
    inside a different one."""
    rng = random.Random(f"kvrag-data-names:{seed}")
    per_unit = sum(_UNIT.values()) + _UNIT["person"]  # people take two words
    need = {split: per_unit * _SCALE[split] for split in SPLITS}
    words, seen, joined = [], set(), ""
    while len(words) < sum(need.values()):
        w = _word(rng).lower()
        parts = {w[i:j] for i in range(len(w)) for j in range(i + 5, len(w) + 1)}
        if not 5 <= len(w) <= 9 or w in joined or parts & seen:
            continue
        seen.add(w)
        joined += "|" + w
        words.append(w.capitalize())
    pools, start = {}, 0
    for split in SPLITS:
        pools[split], start = words[start : start + need[split]], start + need[split]
    return pools


# ---- the world ----------------------------------------------------------------------------------------


def _build_world(split: str, seed: int, prose: float = 0.0) -> list[_Entity]:
    rng = random.Random(f"kvrag-data-world:{seed}:{split}")
    words = iter(_name_pools(seed)[split])
    size = {kind: n * _SCALE[split] for kind, n in _UNIT.items()}
    countries = [next(words) for _ in range(size["country"])]
    rivers = [f"{next(words)} River" for _ in range(size["river"])]
    cities = [
        _Entity("city", next(words), {"country": rng.choice(countries), "river": rivers[i % len(rivers)],
                                      "population": f"{rng.randrange(12, 900)},{rng.randrange(100, 1000)}"})
        for i in range(size["city"])
    ]
    companies = [_Entity("company", f"{next(words)} {rng.choice(['Works', 'Company', 'Brothers', 'Industries'])}", {})
                 for _ in range(size["company"])]
    people = [_Entity("person", f"{next(words)} {next(words)}", {}) for _ in range(size["person"])]
    works = [_Entity("work", f"The {next(words)} {rng.choice(WORK_NOUNS)}", {}) for _ in range(size["work"])]
    for p in people:
        p.facts = {"born": str(rng.randrange(1880, 1990)), "birthplace": rng.choice(cities).name,
                   "occupation": rng.choice(OCCUPATIONS), "employer": rng.choice(companies).name}
    for c in companies:
        c.facts = {"founded": str(rng.randrange(1780, 1980)), "headquarters": rng.choice(cities).name,
                   "founder": rng.choice(people).name, "product": rng.choice(PRODUCTS)}
    for w in works:
        w.facts = {"creator": rng.choice(people).name, "year": str(rng.randrange(1900, 2020)),
                   "setting": rng.choice(cities).name, "kind": rng.choice(WORK_KINDS)}
    entities = people + companies + cities + works
    for e in entities:
        if rng.random() < 0.5:  # half the entities leave one fact out: the unanswerable questions' subjects
            e.withheld = rng.choice([a for a in e.facts if (e.kind, a) in _SINGLE])
        e.passage = _render(e, rng)
    # a stream of its own, so that the facts and the plain passages stay what they are without prose
    style = random.Random(f"kvrag-data-prose:{seed}:{split}")
    for e in entities:
        if style.random() < prose:
            e.prose = True
            kind_extras = _EXTRAS[e.kind]
            extra = style.choice(sorted(kind_extras))
            e.facts[extra] = kind_extras[extra][0](style)
            e.passage = _render_prose(e, style)
    return entities


# ---- passages -------------------------------------------------------------------------------------------

_FACT_SENTENCES = {
    ("person", "born"): ["{name} was born in {v}.", "Records give {v} as the year of {short}'s birth.",
                         "{short} came into the world in {v}."],
    ("person", "birthplace"): ["{short} was born in the city of {v}.", "{name} grew up in {v}, the city of {their} birth.",
                               "{v} is the city where {short} was born."],
    ("person", "occupation"): ["{name} works as a {v}.", "By trade, {short} is a {v}.",
                               "{short} has made a living as a {v} for most of {their} life."],
    ("person", "employer"): ["{short} is employed by {v}.", "For many years {short} has worked for {v}.",
                             "{name}'s employer is {v}."],
    ("company", "founded"): ["{name} was founded in {v}.", "The firm dates from {v}, the year it was founded.",
                             "{name} opened its doors in {v}."],
    ("company", "headquarters"): ["Its headquarters are in {v}.", "{name} is based in the city of {v}.",
                                  "The company keeps its head office in {v}."],
    ("company", "founder"): ["It was founded by {v}.", "{v} founded the company.", "The founder of {name} is {v}."],
    ("company", "product"): ["{name} makes {v}.", "The company is best known for its {v}.", "Its workshops produce {v}."],
    ("city", "country"): ["{name} is a city in {v}.", "{name} lies in the country of {v}.", "The city belongs to {v}."],
    ("city", "river"): ["The {v} flows through {name}.", "{name} stands on the banks of the {v}.",
                        "The {v} runs through the middle of the city."],
    ("city", "population"): ["{name} has a population of {v}.", "About {v} people live in {name}.",
                             "The city is home to {v} inhabitants."],
    ("work", "creator"): ["It was created by {v}.", "{v} is the author of {name}.", "{name} is the work of {v}."],
    ("work", "year"): ["{name} first appeared in {v}.", "It was first presented to the public in {v}.",
                       "{name} came out in {v}."],
    ("work", "setting"): ["The story is set in the city of {v}.", "{name} takes place in {v}.", "Its setting is the city of {v}."],
    ("work", "kind"): ["{name} is a {v}.", "The work is a {v}."],
}

_INTROS = {
    "person": ["This entry is about {name}.", "{name} is mentioned in several regional records.",
               "The following notes concern {name}."],
    "company": ["This entry is about {name}.", "{name} is a business with a long history.",
                "The following notes concern the firm {name}."],
    "city": ["This entry is about {name}.", "{name} is a city with a busy market.", "The following notes concern {name}."],
    "work": ["This entry is about {name}.", "{name} is often discussed by critics.", "The following notes concern {name}."],
}

_COLOUR = {
    "person": ["Colleagues describe {short} as patient and exacting.", "{short} keeps detailed notebooks and rarely throws one away.",
               "Friends say {short} enjoys long walks on quiet evenings.", "{short} once said that good work takes time.",
               "In interviews {short} speaks modestly about {their} achievements.",
               "{short} has given talks to students on several occasions.",
               "Neighbours remember {short} as generous with advice."],
    "company": ["The company has changed its logo several times.", "Its workshops are known for careful craftsmanship.",
                "The firm publishes a small catalogue every spring.", "Apprentices train there for three years.",
                "The company survived more than one difficult decade.", "Its staff hold an annual dinner in the winter."],
    "city": ["The old town has narrow streets and a covered market.", "Visitors often remark on its many bridges.",
             "A festival of lanterns is held there every autumn.", "The city library is housed in a former customs hall.",
             "Its tram network was extended several times.", "Local bakers are proud of a sweet bread with seeds."],
    "work": ["Critics praised its careful structure.", "Some readers found the ending surprising.",
             "It has been translated and adapted several times.", "Its opening is often quoted.",
             "The work was revised before a later edition.", "Audiences responded warmly to its humour."],
}


def _render(e: _Entity, rng: random.Random) -> str:
    short = e.name.split()[-1] if e.kind == "person" else e.name
    fill = {"name": e.name, "short": short, "their": "their"}
    facts = [a for a in e.facts if a != e.withheld]
    rng.shuffle(facts)
    sentences = [rng.choice(_INTROS[e.kind]).format(**fill)]
    sentences += [rng.choice(_FACT_SENTENCES[(e.kind, a)]).format(v=e.facts[a], **fill) for a in facts]
    colour = rng.sample(_COLOUR[e.kind], rng.randrange(3, 6))
    for sentence in colour:  # colour between the facts, not only after them
        sentences.insert(rng.randrange(1, len(sentences) + 1), sentence.format(**fill))
    return " ".join(sentences)


# ---- connected prose (training data) ----------------------------------------------------------------------
# The plain passages state one fact per sentence, always by name. Real text packs several facts into
# one sentence, refers back with "it" or "the firm", and states facts nobody asks about in the
# fourteen templates. A model tuned on plain passages alone learns those templates and, at full
# adapter strength, fails on real text (docs/finetuning.md), so training may mix in this style.


def _invented(style: random.Random, parts: int = 3) -> str:
    return "".join(style.choice(_ONSETS) + style.choice(_VOWELS) for _ in range(parts)).capitalize()


def _invented_person(style: random.Random) -> str:
    return f"{_invented(style)} {_invented(style)}"


# kind -> attribute -> (value maker, sentence, question, target); asked only of prose entities
_EXTRAS = {
    "person": {
        "nickname": (_invented, "Friends call {short} by the nickname {v}.", "What is {name}'s nickname?",
                     "{name} is nicknamed {v}."),
        "mentor": (_invented_person, "{short} learned the trade from {v}.",
                   "Who taught {name} the trade?", "{name} learned the trade from {v}."),
    },
    "company": {
        "chief engineer": (_invented_person, "The chief engineer of {name} is {v}.",
                           "Who is the chief engineer of {name}?", "The chief engineer of {name} is {v}."),
        "motto": (lambda s: f"{_invented(s, 2)} {_invented(s, 2).lower()}", "The motto of the firm is \"{v}\".",
                  "What is the motto of {name}?", "The motto of {name} is \"{v}\"."),
    },
    "city": {
        "local dish": (lambda s: f"{_invented(s).lower()} {s.choice(['stew', 'pie', 'bread', 'soup'])}",
                       "The local dish of {name} is {v}, eaten on feast days.", "What is the local dish of {name}?",
                       "The local dish of {name} is {v}."),
        "mayor": (_invented_person, "The mayor of {name} is {v}.", "Who is the mayor of {name}?",
                  "The mayor of {name} is {v}."),
    },
    "work": {
        "main character": (_invented_person, "Its main character is {v}.",
                           "Who is the main character of {name}?", "The main character of {name} is {v}."),
        "first performer": (_invented_person, "It was first performed by {v}.",
                            "Who first performed {name}?", "{name} was first performed by {v}."),
    },
}

# kind -> two attributes -> sentences stating both
_PAIRS = {
    "person": {
        ("born", "birthplace"): ["Born in {birthplace} in {born}, {short} spent a quiet childhood by the water.",
                                 "{name} was born in {born} in {birthplace}, where the family had lived for generations."],
        ("occupation", "employer"): ["As a {occupation}, {short} has spent most of a long career at {employer}.",
                                     "{short} works at {employer}, where the other staff know {short} as a careful {occupation}."],
        ("born", "occupation"): ["{name}, a {occupation} born in {born}, is well known beyond the trade."],
        ("birthplace", "employer"): ["After leaving {birthplace}, the city of {their} birth, {short} joined {employer}."],
    },
    "company": {
        ("founded", "founder"): ["{founder} set up {name} in {founded}.", "The firm was founded in {founded} by {founder}."],
        ("headquarters", "product"): ["From its head office in {headquarters}, {name} sells {product} across the region.",
                                      "Its workshops in {headquarters}, where it is based, turn out {product}."],
        ("founded", "headquarters"): ["Founded in {founded}, the company has always kept its head office in {headquarters}."],
        ("founder", "product"): ["{founder}, who founded the company, wanted it to make the best {product} anywhere."],
    },
    "city": {
        ("country", "river"): ["{name}, a city in {country}, grew up on both banks of the {river}."],
        ("population", "country"): ["With about {population} inhabitants, {name} is one of the busier cities of {country}."],
        ("river", "population"): ["The {river} winds past the homes of the {population} people who live in {name}."],
    },
    "work": {
        ("creator", "year"): ["{creator} created {name}, which first appeared in {year}."],
        ("kind", "setting"): ["{name} is a {kind} set in the city of {setting}."],
        ("year", "kind"): ["First presented to the public in {year}, the {kind} found an audience slowly."],
        ("creator", "setting"): ["{creator} set {name} in {setting}, a city the author knew well."],
    },
}

_REF = {"person": "{short}", "company": "The firm", "city": "The city", "work": "The work"}

_PROSE_COLOUR = [
    "Little of this was planned, and much of it happened by chance.",
    "Accounts of those years differ in the details but agree on the outline.",
    "Local newspapers have returned to the story more than once.",
    "Not everyone was pleased, and the arguments lasted for a long time.",
    "A small exhibition once told the whole story with letters and photographs.",
    "Some of the early papers were lost in a flood and never recovered.",
]


def _render_prose(e: _Entity, style: random.Random) -> str:
    """The entity's stated facts (its extra one included) as connected prose: two facts to a sentence
    where a pair fits, later sentences referring back without the name, colour in between."""
    short = e.name.split()[-1] if e.kind == "person" else e.name
    fill = {"name": e.name, "short": short, "their": "their"}
    left = [a for a in e.facts if a != e.withheld]
    style.shuffle(left)
    sentences = []
    pairs = list(_PAIRS[e.kind].items())
    style.shuffle(pairs)
    for (a, b), templates in pairs:
        if a in left and b in left and style.random() < 0.7:
            sentences.append(style.choice(templates).format(**{a: e.facts[a], b: e.facts[b]}, **fill))
            left = [x for x in left if x not in (a, b)]
    for a in left:
        if a in _EXTRAS[e.kind]:
            sentences.append(_EXTRAS[e.kind][a][1].format(v=e.facts[a], **fill))
        else:
            sentence = style.choice(_FACT_SENTENCES[(e.kind, a)]).format(v=e.facts[a], **fill)
            if sentences and sentence.startswith(e.name) and style.random() < 0.5:  # refer back, as prose does
                sentence = _REF[e.kind].format(**fill) + sentence[len(e.name):]
            sentences.append(sentence)
    style.shuffle(sentences)
    intro = style.choice(_INTROS[e.kind]).format(**fill)
    sentences.insert(0, intro)
    colour = style.sample(_COLOUR[e.kind], style.randrange(1, 4)) + style.sample(_PROSE_COLOUR, style.randrange(1, 3))
    for sentence in colour:
        sentences.insert(style.randrange(1, len(sentences) + 1), sentence.format(**fill))
    return " ".join(sentences)


# ---- questions -----------------------------------------------------------------------------------------

# (kind, attribute) -> (question, target sentence)
_SINGLE = {
    ("person", "born"): ("In what year was {name} born?", "{name} was born in {v}."),
    ("person", "birthplace"): ("In which city was {name} born?", "{name} was born in {v}."),
    ("person", "occupation"): ("What is {name}'s occupation?", "{name} is a {v}."),
    ("person", "employer"): ("Which company does {name} work for?", "{name} works for {v}."),
    ("company", "founded"): ("In what year was {name} founded?", "{name} was founded in {v}."),
    ("company", "headquarters"): ("In which city is {name} based?", "{name} is based in {v}."),
    ("company", "founder"): ("Who founded {name}?", "{name} was founded by {v}."),
    ("company", "product"): ("What does {name} make?", "{name} makes {v}."),
    ("city", "country"): ("In which country is {name}?", "{name} is in {v}."),
    ("city", "river"): ("Which river flows through {name}?", "The {v} flows through {name}."),
    ("city", "population"): ("How many people live in {name}?", "About {v} people live in {name}."),
    ("work", "creator"): ("Who created {name}?", "{name} was created by {v}."),
    ("work", "year"): ("In what year did {name} first appear?", "{name} first appeared in {v}."),
    ("work", "setting"): ("In which city is {name} set?", "{name} is set in {v}."),
}

# other ways to ask the same; prose entities are asked in one of them or in the form above
_REPHRASED = {
    ("person", "born"): ["When was {name} born?", "What year was {name} born in?"],
    ("person", "birthplace"): ["Where was {name} born?", "What is the birthplace of {name}?"],
    ("person", "occupation"): ["What does {name} do for a living?", "What is {name}'s trade?"],
    ("person", "employer"): ["Who employs {name}?", "Which firm is {name} employed by?"],
    ("company", "founded"): ["When was {name} founded?", "What year did {name} open its doors?"],
    ("company", "headquarters"): ["Where is {name} based?", "Where is the head office of {name}?"],
    ("company", "founder"): ["Who is the founder of {name}?", "Who set up {name}?"],
    ("company", "product"): ["What is {name} known for making?", "What products does {name} sell?"],
    ("city", "country"): ["Which country is {name} in?", "In what country does {name} lie?"],
    ("city", "river"): ["What is the name of the river that flows through {name}?", "Which river runs through {name}?"],
    ("city", "population"): ["What is the population of {name}?", "How many inhabitants does {name} have?"],
    ("work", "creator"): ["Who is the author of {name}?", "Who made {name}?"],
    ("work", "year"): ["When did {name} first appear?", "What year did {name} come out?"],
    ("work", "setting"): ["Where is {name} set?", "What city does {name} take place in?"],
}

# (kind, link attribute, target attribute) -> (question, target sentence); {mid} is the linked entity
_BRIDGE = {
    ("person", "birthplace", "country"): ("In which country was {name} born?", "{name} was born in {mid}, which is in {v}."),
    ("person", "birthplace", "river"): ("Which river flows through the city where {name} was born?",
                                        "{name} was born in {mid}, where the {v} flows."),
    ("person", "employer", "headquarters"): ("In which city is the company that {name} works for based?",
                                             "{name} works for {mid}, which is based in {v}."),
    ("person", "employer", "founded"): ("In what year was the company that {name} works for founded?",
                                        "{name} works for {mid}, founded in {v}."),
    ("company", "founder", "birthplace"): ("In which city was the founder of {name} born?",
                                           "{name} was founded by {mid}, who was born in {v}."),
    ("company", "founder", "born"): ("In what year was the founder of {name} born?",
                                     "{name} was founded by {mid}, who was born in {v}."),
    ("company", "headquarters", "country"): ("In which country is {name} based?", "{name} is based in {mid}, in {v}."),
    ("work", "creator", "birthplace"): ("In which city was the creator of {name} born?",
                                        "{name} was created by {mid}, who was born in {v}."),
    ("work", "creator", "employer"): ("Which company employs the creator of {name}?",
                                      "{name} was created by {mid}, who works for {v}."),
    ("work", "setting", "river"): ("Which river flows through the city where {name} is set?",
                                   "{name} is set in {mid}, where the {v} flows."),
}

# kind -> (attribute, question, target sentence); the smaller value wins unless "more" is in the question
_COMPARISON = {
    "person": ("born", "Who was born earlier, {a} or {b}?", "{v} was born earlier."),
    "company": ("founded", "Which company was founded earlier, {a} or {b}?", "{v} was founded earlier."),
    "city": ("population", "Which city has more inhabitants, {a} or {b}?", "{v} has more inhabitants."),
    "work": ("year", "Which appeared first, {a} or {b}?", "{v} appeared first."),
}


def _stated(e: _Entity, attribute: str) -> bool:
    return attribute in e.facts and attribute != e.withheld


def _candidates(world: list[_Entity]) -> dict[str, list[dict]]:
    """Every question the world allows, by type: text, answers, gold entities and what must stay out of
    the distractors."""
    by_name = {e.name: e for e in world}
    out = {t: [] for t in QUESTION_TYPES}
    for e in world:
        for (kind, attr), (question, target) in _SINGLE.items():
            if kind != e.kind:
                continue
            if e.prose:
                question = random.Random(f"{e.name}:{attr}").choice([question, *_REPHRASED[(kind, attr)]])
            v = e.facts[attr]
            if _stated(e, attr):
                out["single"].append(dict(question=question.format(name=e.name), answers=(v,),
                                          target=target.format(name=e.name, v=v), gold=(e,), absent=(v,)))
            elif v.lower() not in e.passage.lower():
                out["unanswerable"].append(dict(question=question.format(name=e.name), answers=REFUSALS,
                                                target=UNANSWERABLE_TARGET, gold=(e,), absent=(v,)))
        for attr, (_, _, question, target) in _EXTRAS[e.kind].items():
            if attr in e.facts:
                v = e.facts[attr]
                out["single"].append(dict(question=question.format(name=e.name), answers=(v,),
                                          target=target.format(name=e.name, v=v), gold=(e,), absent=(v,)))
        for (kind, link, attr), (question, target) in _BRIDGE.items():
            if kind != e.kind or not _stated(e, link):
                continue
            mid = by_name[e.facts[link]]
            if not _stated(mid, attr):
                continue
            v = mid.facts[attr]
            out["bridge"].append(dict(question=question.format(name=e.name), answers=(v,),
                                      target=target.format(name=e.name, mid=mid.name, v=v), gold=(e, mid), absent=(v,)))
    for kind, (attr, question, target) in _COMPARISON.items():
        group = [e for e in world if e.kind == kind and _stated(e, attr)]
        value = {e.name: int(e.facts[attr].replace(",", "")) for e in group}
        more = "more" in question
        for a, b in itertools.combinations(group, 2):
            if value[a.name] == value[b.name]:
                continue
            win, lose = (a, b) if (value[a.name] > value[b.name]) == more else (b, a)
            out["comparison"].append(dict(question=question.format(a=a.name, b=b.name), answers=(win.name,),
                                          target=target.format(v=win.name), gold=(a, b), absent=(win.name,),
                                          wrong=(lose.name,)))
    return out


def generate(split: str = "test", n: int = 200, passages: int = 10, noise: float = 0.5, seed: int = 0,
             prose: float = 0.0) -> list[QAExample]:
    """`n` questions of the split, the four types in turn, each with `passages` passages (5-30).

    The distractors are passages that do not contain the answer; a share `noise` of them is drawn
    from the whole world, the rest are hard distractors: passages about entities of the same kind
    as the one asked about, which state the same kinds of facts. Same arguments, same questions.

    `prose`: the share of entities whose passage is rewritten as connected prose, with one more fact
    and their questions asked in other words; the facts, and every other passage, are the same as
    without it.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 5 <= passages <= 30:
        raise ValueError(f"passages must be between 5 and 30, got {passages}")
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise must be between 0 and 1, got {noise}")
    if not 0.0 <= prose <= 1.0:
        raise ValueError(f"prose must be between 0 and 1, got {prose}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    world = _build_world(split, seed, prose)
    rng = random.Random(f"kvrag-data-questions:{seed}:{split}:{passages}:{noise}")
    pools = _candidates(world)
    for pool in pools.values():
        rng.shuffle(pool)
    examples = []
    for i in range(n):
        kind = QUESTION_TYPES[i % len(QUESTION_TYPES)]
        pool = pools[kind]
        c = pool[(i // len(QUESTION_TYPES)) % len(pool)]
        examples.append(_example(f"{split}-{i}", split, kind, c, world, passages, noise, rng))
    return examples


def _example(qid, split, kind, c, world, k, noise, rng) -> QAExample:
    gold = list(c["gold"])
    clean = [e for e in world if e not in gold and not any(v.lower() in e.passage.lower() for v in c["absent"])]
    hard = [e for e in clean if e.kind == gold[0].kind]
    n_distract = k - len(gold)
    n_hard = min(len(hard), round(n_distract * (1 - noise)))
    chosen = rng.sample(hard, n_hard)
    rest = [e for e in clean if e not in chosen]
    chosen += rng.sample(rest, n_distract - n_hard)
    entities = gold + chosen
    rng.shuffle(entities)
    return QAExample(
        id=qid,
        split=split,
        type=kind,
        question=c["question"],
        answers=tuple(c["answers"]),
        target=c["target"],
        passages=tuple(e.passage for e in entities),
        gold=tuple(sorted(entities.index(g) for g in gold)),
        wrong=tuple(c.get("wrong", ())),
    )
