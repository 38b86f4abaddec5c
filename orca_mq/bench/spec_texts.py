"""The speculative-decoding benchmark's texts (tools/bench_spec.py), written here so that it needs no
network: plain-English paragraphs (60-120 words) that copy-heavy requests correct, rewrite or extract
from, and open-ended prompts that leave nothing to copy."""
from __future__ import annotations

PARAGRAPHS: tuple[str, ...] = (
    "The old lighthouse stands at the end of a narrow stone path that runs along the cliff. For more than a "
    "hundred years its lamp warned ships away from the rocks below. Today the light is automatic, and the keeper's "
    "cottage has become a small museum. Visitors can climb the spiral staircase to the top, where the wind is strong "
    "and the view stretches for miles across the grey water. On clear evenings, people gather there to watch the sun "
    "go down behind the distant islands.",
    "Bread is one of the oldest foods that people make. At its simplest, it needs only flour, water, salt and yeast. "
    "The yeast feeds on the sugars in the flour and releases gas, which makes the dough rise. Kneading the dough "
    "builds a network of gluten that traps the gas and gives the bread its structure. After a long, slow rise, the "
    "loaf is baked in a hot oven until the crust turns golden brown and sounds hollow when tapped.",
    "Our town library opened a new reading room last spring. It has tall windows, comfortable chairs and a long "
    "wooden table where students can work in the afternoon. The librarians also started a weekly club for children, "
    "who meet on Saturday mornings to read stories aloud and talk about the books they like. Since the room opened, "
    "the number of visitors has almost doubled, and the library now plans to stay open later on weekdays.",
    "Honey bees live in large colonies that can hold tens of thousands of workers. Each bee has a job that changes "
    "as it grows older. Young bees clean the hive and feed the larvae, while older bees leave to collect nectar and "
    "pollen from flowers. When a worker finds a good patch of flowers, it returns to the hive and performs a dance "
    "that tells the others where to fly. This simple signal helps the whole colony gather food quickly.",
    "The train left the station a few minutes after seven in the morning. Most of the passengers were still sleepy, "
    "holding cups of coffee and looking out at the fields covered in frost. As the sun climbed higher, the frost "
    "melted and the countryside turned green again. A small child near the window counted the cows they passed, "
    "and by the time the train reached the city, she had counted more than two hundred of them.",
    "Learning to play the piano takes patience and regular practice. Beginners usually start with simple scales to "
    "train their fingers and learn where the notes are. After a few weeks, they can play short pieces with both hands "
    "together. Many teachers suggest practicing for twenty minutes every day rather than for two hours once a week, "
    "because the hands and the mind remember better when the lessons are short and frequent.",
    "The city council met on Tuesday evening to discuss the plan for the new park. The park will be built on the land "
    "where the old factory used to stand. It will include a playground, a small pond, walking paths and a garden "
    "where residents can grow their own vegetables. Several people at the meeting asked for more trees and benches, "
    "and the council agreed to change the design before the work begins next summer.",
    "Water moves around the planet in a cycle that never stops. The sun warms the oceans, lakes and rivers, and some "
    "of the water turns into vapour and rises into the air. As the vapour cools, it forms clouds made of tiny drops. "
    "When the drops grow heavy enough, they fall back to the ground as rain or snow. The water then flows into "
    "rivers and soaks into the soil, and the cycle begins again.",
    "My grandmother kept a small garden behind her house for almost forty years. Every spring she planted tomatoes, "
    "beans, lettuce and a row of bright yellow sunflowers along the fence. She never used a written plan, but she "
    "always knew exactly where each plant should go. In the summer, she gave away baskets of vegetables to her "
    "neighbours, and in the autumn she saved the seeds from her best plants for the following year.",
    "A good night's sleep does more than help us feel rested. While we sleep, the body repairs its muscles and the "
    "brain sorts through the events of the day, storing some memories and letting others fade. Adults usually need "
    "between seven and nine hours each night. People who sleep too little often find it harder to concentrate, and "
    "over time they may become more likely to catch colds and other illnesses.",
    "The museum's new exhibition tells the story of early flight. It begins with paper kites and hot air balloons and "
    "moves on to the first gliders and powered aircraft. One room holds a full-size copy of a wooden plane built more "
    "than a century ago, hanging from the ceiling by thin steel wires. Visitors can also sit in a simple flight "
    "simulator and try to land a small plane on a grass field.",
    "Recycling helps reduce the amount of waste that ends up in landfills. Paper, glass, metal and many kinds of "
    "plastic can be collected, cleaned and turned into new products. To make recycling work well, it is important to "
    "rinse containers and to sort materials into the right bins. When items are mixed together or covered in food, "
    "they are much harder to process, and a whole load may have to be thrown away.",
    "Every winter, thousands of birds fly south to escape the cold weather. Some of them travel only a few hundred "
    "miles, while others cross entire oceans. Scientists believe that birds use several clues to find their way, "
    "including the position of the sun, the patterns of the stars and the magnetic field of the earth. Young birds "
    "often make their first journey without any help from their parents.",
    "The bakery on the corner opens at six o'clock every morning. By then, the bakers have already been working for "
    "hours, mixing dough, shaping rolls and filling trays with cinnamon buns. The smell of fresh bread drifts down "
    "the street and draws in people on their way to work. On Fridays, the bakery sells a special apple cake, and "
    "there is usually a long line outside the door before it opens.",
    "Volcanoes form where melted rock from deep inside the earth rises to the surface. When the pressure becomes too "
    "great, the volcano erupts and sends out lava, ash and gas. Some eruptions are gentle, with rivers of lava "
    "flowing slowly down the slopes, while others are violent explosions that throw ash high into the sky. Over "
    "thousands of years, the cooled lava can build mountains and even create new islands in the sea.",
    "Writing a clear letter is a useful skill at work and at home. Start by saying why you are writing, so that the "
    "reader knows what to expect. Keep the sentences short and explain one idea at a time. If you are asking for "
    "something, say exactly what you need and by when. Before you send the letter, read it again slowly to check the "
    "spelling, the names and the dates, and remove anything that is not needed.",
)

# Copy-heavy tasks: the answer is mostly the paragraph's own words.
COPY_TASKS: tuple[str, ...] = (
    "Correct the spelling mistakes in this paragraph and return the corrected paragraph only:\n\n{text}",
    "Rewrite this paragraph with every spelling mistake fixed, keeping all of its sentences:\n\n{text}",
    "Extract the first three sentences of this paragraph, word for word:\n\n{text}",
    "Return this paragraph as a bulleted list, one sentence per bullet, with the spelling corrected:\n\n{text}",
)

# Nothing to copy: the answer's words are the model's own.
OPEN_PROMPTS: tuple[str, ...] = (
    "Write a short poem about the sea at night.",
    "Explain why the sky is blue.",
    "Describe a perfect day in the mountains.",
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator keeps food cold.",
    "Give some advice to someone starting their first job.",
    "Write a short poem about autumn leaves.",
    "Explain why people need to drink water.",
    "Describe the city of the future.",
    "Write a letter to a friend about your summer holiday.",
    "Explain how plants make their food.",
    "Write a short story about a lost dog finding its way home.",
    "Describe what makes a good teacher.",
    "Explain why exercise is good for the heart.",
    "Write a short poem about a rainy morning.",
    "Tell me about the history of the bicycle.",
)
