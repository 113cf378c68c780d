"""The tasks of the ``json-extract`` dataset (:mod:`selfspec.data.jsonextract`): written for
selfspec, so no model saw them in training and no benchmark shares them.

Each task is a short passage, an instruction and a JSON schema of 3-8 fields of mixed types
(strings, integers, numbers, booleans, enums, arrays of strings, a nested object in some),
with the reference answer a careful reader would give. Every object closes its properties
(``additionalProperties: false``) and requires all of them, strings and arrays are bounded
(``maxLength``, ``maxItems``) and numbers ranged, so that a complete answer fits in 128
tokens of a 49k-token vocabulary and a constrained decoder cannot run on forever inside one
value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class JsonTask:
    """One extraction task.

    Attributes:
        id: the prompt id, ``json-extract/<name>``.
        name: the schema's name (OpenAI ``response_format.json_schema.name``).
        instruction: what to extract.
        passage: the text to extract it from.
        schema: the JSON schema the answer must validate against.
        reference: the expected answer (validates against ``schema``).
    """

    id: str
    name: str
    instruction: str
    passage: str
    schema: dict[str, Any]
    reference: dict[str, Any]


def _s(max_length: int = 60) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


def _int(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


def _num(low: float, high: float) -> dict[str, Any]:
    return {"type": "number", "minimum": low, "maximum": high}


def _enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


def _strings(max_items: int, max_length: int = 40) -> dict[str, Any]:
    return {"type": "array", "items": _s(max_length), "maxItems": max_items}


_BOOL: dict[str, Any] = {"type": "boolean"}
_DATE: dict[str, Any] = {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}
_TIME: dict[str, Any] = {"type": "string", "pattern": r"^\d{2}:\d{2}$"}


def _object(**properties: dict[str, Any]) -> dict[str, Any]:
    """A closed object requiring every property, in the order given."""
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def _task(name: str, instruction: str, passage: str, schema: dict[str, Any],
          reference: dict[str, Any]) -> JsonTask:
    return JsonTask(f"json-extract/{name}", name, instruction, passage, schema, reference)


#: The reported (held-out) tasks, in dataset order.
HELD_OUT_TASKS: tuple[JsonTask, ...] = (
    _task(
        "invoice",
        "Extract the invoice details.",
        "INVOICE #INV-20931 from Baltic Paper Supplies (Riga, Latvia), issued 2025-03-14. "
        "Bill to: Harbor Print Studio. 40 reams of A4 copy paper and 6 toner cartridges. "
        "Total due: 1,284.50 EUR within 30 days. This invoice has not been paid yet.",
        _object(invoice_number=_s(20),
                vendor=_object(name=_s(), country=_s(40)),
                issue_date=_DATE, total=_num(0, 1_000_000), currency=_enum("EUR", "USD", "GBP"),
                paid=_BOOL),
        {"invoice_number": "INV-20931",
         "vendor": {"name": "Baltic Paper Supplies", "country": "Latvia"},
         "issue_date": "2025-03-14", "total": 1284.5, "currency": "EUR", "paid": False}),
    _task(
        "event",
        "Extract the event details.",
        "Join us for the Lakeside Jazz Night on Saturday 2025-07-19 at the Marina Pavilion. "
        "Doors open at 19:30. Tickets cost 25 dollars and the venue holds 300 people. "
        "Performers: the Ellis Trio, Nora Vance and the Harbor Horns. Outdoor seating only.",
        _object(title=_s(), date=_DATE, start_time=_TIME, venue=_s(), ticket_price=_num(0, 1000),
                capacity=_int(1, 100_000), performers=_strings(6), outdoor=_BOOL),
        {"title": "Lakeside Jazz Night", "date": "2025-07-19", "start_time": "19:30",
         "venue": "Marina Pavilion", "ticket_price": 25, "capacity": 300,
         "performers": ["Ellis Trio", "Nora Vance", "Harbor Horns"], "outdoor": True}),
    _task(
        "product",
        "Extract the product listing.",
        "The Aurora X2 wireless headphones by Soundcraft Labs are back in stock at 149.99 USD. "
        "They offer 40 hours of battery life, weigh 250 grams and come in black, silver and "
        "midnight blue. Category: audio.",
        _object(name=_s(), brand=_s(), price=_num(0, 100_000), in_stock=_BOOL,
                battery_hours=_int(0, 1000), colors=_strings(6, 30),
                category=_enum("audio", "computers", "phones", "home", "other")),
        {"name": "Aurora X2", "brand": "Soundcraft Labs", "price": 149.99, "in_stock": True,
         "battery_hours": 40, "colors": ["black", "silver", "midnight blue"],
         "category": "audio"}),
    _task(
        "recipe",
        "Extract the recipe summary.",
        "Grandma's lentil soup serves 6 and takes 45 minutes. You need red lentils, carrots, "
        "onion, garlic, cumin and vegetable stock. It is vegan and easy to make.",
        _object(title=_s(), servings=_int(1, 50), total_minutes=_int(1, 1440),
                ingredients=_strings(10, 30), vegan=_BOOL,
                difficulty=_enum("easy", "medium", "hard")),
        {"title": "Grandma's lentil soup", "servings": 6, "total_minutes": 45,
         "ingredients": ["red lentils", "carrots", "onion", "garlic", "cumin",
                         "vegetable stock"],
         "vegan": True, "difficulty": "easy"}),
    _task(
        "bug-report",
        "Turn this message into a bug report.",
        "Since version 3.2.1 the export button crashes the desktop app on Windows 11 whenever "
        "the project has more than 500 layers. It happens every time. This blocks our whole "
        "design team, so please treat it as critical.",
        _object(title=_s(80), version=_s(20), platform=_enum("windows", "macos", "linux",
                                                              "web"),
                severity=_enum("low", "medium", "high", "critical"), reproducible=_BOOL,
                steps=_strings(5, 60)),
        {"title": "Export button crashes the desktop app", "version": "3.2.1",
         "platform": "windows", "severity": "critical", "reproducible": True,
         "steps": ["Open a project with more than 500 layers", "Click the export button"]}),
    _task(
        "flight",
        "Extract the flight booking.",
        "Your flight NK 482 departs Oslo (OSL) at 07:15 on 2025-09-02 and arrives in "
        "Barcelona (BCN) at 11:05. Seat 14C, economy class. One checked bag is included.",
        _object(flight_number=_s(10),
                departure=_object(airport=_s(3), time=_TIME),
                arrival=_object(airport=_s(3), time=_TIME),
                date=_DATE, seat=_s(4), cabin=_enum("economy", "premium", "business", "first"),
                checked_bags=_int(0, 5)),
        {"flight_number": "NK 482", "departure": {"airport": "OSL", "time": "07:15"},
         "arrival": {"airport": "BCN", "time": "11:05"}, "date": "2025-09-02",
         "seat": "14C", "cabin": "economy", "checked_bags": 1}),
    _task(
        "medical-appointment",
        "Extract the appointment details.",
        "Reminder: Dr. Amira Haddad (dermatology) will see you on 2025-05-08 at 14:40 at the "
        "Westside Clinic, room 212. Fasting is not required. This is a "
        "follow-up visit and it will be held in person.",
        _object(doctor=_s(), specialty=_s(40), date=_DATE, time=_TIME, location=_s(),
                follow_up=_BOOL, mode=_enum("in person", "video", "phone")),
        {"doctor": "Amira Haddad", "specialty": "dermatology", "date": "2025-05-08",
         "time": "14:40", "location": "Westside Clinic, room 212", "follow_up": True,
         "mode": "in person"}),
    _task(
        "job-posting",
        "Extract the job posting.",
        "Brightwave Analytics is hiring a Senior Data Engineer in Toronto. The salary range "
        "is 120,000 to 145,000 CAD per year. Remote work is allowed two days a week. "
        "Required skills: Python, SQL, Spark and Airflow. At least 5 years of experience.",
        _object(title=_s(), company=_s(), location=_s(40),
                salary=_object(min=_int(0, 10_000_000), max=_int(0, 10_000_000),
                               currency=_enum("CAD", "USD", "EUR")),
                remote=_BOOL, skills=_strings(8, 30), years_experience=_int(0, 40)),
        {"title": "Senior Data Engineer", "company": "Brightwave Analytics",
         "location": "Toronto", "salary": {"min": 120000, "max": 145000, "currency": "CAD"},
         "remote": True, "skills": ["Python", "SQL", "Spark", "Airflow"],
         "years_experience": 5}),
    _task(
        "hotel-booking",
        "Extract the hotel reservation.",
        "Confirmation for Ms. Lena Fischer: 3 nights at Hotel Alpenrose, check-in 2025-12-20, "
        "2 adults in a double room with breakfast included. Total price 540 EUR, free "
        "cancellation until 48 hours before arrival.",
        _object(guest=_s(), hotel=_s(), check_in=_DATE, nights=_int(1, 365), adults=_int(1, 20),
                room=_enum("single", "double", "suite"), breakfast=_BOOL,
                total_price=_num(0, 1_000_000)),
        {"guest": "Lena Fischer", "hotel": "Hotel Alpenrose", "check_in": "2025-12-20",
         "nights": 3, "adults": 2, "room": "double", "breakfast": True, "total_price": 540}),
    _task(
        "real-estate",
        "Extract the property listing.",
        "For sale: a bright 3-bedroom, 2-bathroom townhouse at 18 Willow Lane, Portland, "
        "Oregon. 1,650 square feet, built in 1998, with a garage. Asking price 565,000 USD.",
        _object(kind=_enum("apartment", "townhouse", "house", "land"),
                address=_object(street=_s(), city=_s(40), state=_s(40)),
                bedrooms=_int(0, 50), bathrooms=_int(0, 50), square_feet=_int(0, 100_000),
                year_built=_int(1800, 2030), garage=_BOOL, price=_int(0, 100_000_000)),
        {"kind": "townhouse",
         "address": {"street": "18 Willow Lane", "city": "Portland", "state": "Oregon"},
         "bedrooms": 3, "bathrooms": 2, "square_feet": 1650, "year_built": 1998,
         "garage": True, "price": 565000}),
    _task(
        "car-listing",
        "Extract the used car ad.",
        "2019 Mazda CX-5 Touring, 62,400 km, automatic transmission, petrol. One owner, no "
        "accidents. Asking 24,900 dollars. Features: heated seats, backup camera, Apple "
        "CarPlay.",
        _object(make=_s(30), model=_s(40), year=_int(1950, 2030), mileage_km=_int(0, 2_000_000),
                transmission=_enum("automatic", "manual"),
                fuel=_enum("petrol", "diesel", "electric", "hybrid"), accident_free=_BOOL,
                features=_strings(6, 30)),
        {"make": "Mazda", "model": "CX-5 Touring", "year": 2019, "mileage_km": 62400,
         "transmission": "automatic", "fuel": "petrol", "accident_free": True,
         "features": ["heated seats", "backup camera", "Apple CarPlay"]}),
    _task(
        "weather",
        "Extract tomorrow's forecast.",
        "Tomorrow in Edinburgh: light rain in the morning, clearing by noon. High of 14 "
        "degrees, low of 7. Winds from the west at 25 km/h. Chance of rain 70 percent. No "
        "weather warnings are in effect.",
        _object(city=_s(40), condition=_enum("sunny", "cloudy", "rain", "snow", "storm"),
                high_c=_int(-60, 60), low_c=_int(-60, 60), wind_kmh=_int(0, 400),
                rain_chance=_num(0, 1), warning=_BOOL),
        {"city": "Edinburgh", "condition": "rain", "high_c": 14, "low_c": 7, "wind_kmh": 25,
         "rain_chance": 0.7, "warning": False}),
    _task(
        "bank-transaction",
        "Extract the transaction from this notification.",
        "Card ending 4417: a payment of 82.35 GBP to GreenLeaf Grocers was approved on "
        "2025-02-27. Category: groceries. Your available balance is now 1,903.12 GBP.",
        _object(card_last4=_s(4), amount=_num(0, 1_000_000), currency=_enum("GBP", "EUR", "USD"),
                merchant=_s(), date=_DATE, category=_s(30), approved=_BOOL,
                balance=_num(-1_000_000, 10_000_000)),
        {"card_last4": "4417", "amount": 82.35, "currency": "GBP",
         "merchant": "GreenLeaf Grocers", "date": "2025-02-27", "category": "groceries",
         "approved": True, "balance": 1903.12}),
    _task(
        "match-result",
        "Extract the match result.",
        "The Riverside Rovers beat Northgate United 3-1 at home on Sunday. Scorers for the "
        "Rovers were Diaz, Okafor and Lindqvist; Petrov replied for United. Attendance was "
        "18,250.",
        _object(home_team=_s(40), away_team=_s(40), home_score=_int(0, 50),
                away_score=_int(0, 50), winner=_enum("home", "away", "draw"),
                scorers=_strings(10, 30), attendance=_int(0, 200_000)),
        {"home_team": "Riverside Rovers", "away_team": "Northgate United", "home_score": 3,
         "away_score": 1, "winner": "home", "scorers": ["Diaz", "Okafor", "Lindqvist",
                                                           "Petrov"],
         "attendance": 18250}),
    _task(
        "course",
        "Extract the course information.",
        "CS 214: Introduction to Databases, taught by Prof. Miguel Ortega in the spring term. "
        "4 credits, 60 seats, prerequisites CS 101 and MATH 120. Lectures are online.",
        _object(code=_s(12), title=_s(), instructor=_s(40),
                term=_enum("spring", "summer", "fall", "winter"), credits=_int(0, 20),
                seats=_int(0, 2000), prerequisites=_strings(6, 20), online=_BOOL),
        {"code": "CS 214", "title": "Introduction to Databases", "instructor": "Miguel Ortega",
         "term": "spring", "credits": 4, "seats": 60, "prerequisites": ["CS 101", "MATH 120"],
         "online": True}),
    _task(
        "movie",
        "Extract the film details.",
        "\"The Quiet Meridian\" (2023), directed by Hana Sato, is a 128-minute science fiction "
        "drama starring Idris Cole and Maya Lind. Critics rate it 8.1 out of 10. It is rated "
        "PG-13.",
        _object(title=_s(), year=_int(1880, 2030), director=_s(40), runtime_min=_int(1, 600),
                genres=_strings(4, 30), cast=_strings(6, 40), rating=_num(0, 10),
                certificate=_enum("G", "PG", "PG-13", "R")),
        {"title": "The Quiet Meridian", "year": 2023, "director": "Hana Sato",
         "runtime_min": 128, "genres": ["science fiction", "drama"],
         "cast": ["Idris Cole", "Maya Lind"], "rating": 8.1, "certificate": "PG-13"}),
    _task(
        "support-ticket",
        "Classify this customer email as a support ticket.",
        "Hello, I was charged twice for my March subscription (order 55812). I'd like a "
        "refund of the second charge. I'm quite upset because this is the second time. "
        "- Priya Raman",
        _object(customer=_s(40), order_id=_s(20),
                topic=_enum("billing", "shipping", "technical", "account", "other"),
                sentiment=_enum("positive", "neutral", "negative"), refund_requested=_BOOL,
                summary=_s(100)),
        {"customer": "Priya Raman", "order_id": "55812", "topic": "billing",
         "sentiment": "negative", "refund_requested": True,
         "summary": "Charged twice for the March subscription"}),
    _task(
        "pet-adoption",
        "Extract the adoption profile.",
        "Meet Biscuit, a 2-year-old male beagle mix. He is neutered, vaccinated and great "
        "with children, but he does not get along with cats. Adoption fee: 150 dollars.",
        _object(name=_s(30), species=_enum("dog", "cat", "rabbit", "bird", "other"),
                breed=_s(40), age_years=_int(0, 40), sex=_enum("male", "female"),
                vaccinated=_BOOL, good_with=_strings(4, 20), fee=_num(0, 10_000)),
        {"name": "Biscuit", "species": "dog", "breed": "beagle mix", "age_years": 2,
         "sex": "male", "vaccinated": True, "good_with": ["children"], "fee": 150}),
    _task(
        "conference-talk",
        "Extract the talk from the conference programme.",
        "Room B, 2025-10-09, 10:30-11:15: \"Scaling Search at Low Latency\" by Tomasz Wilk "
        "(Quarry Systems). Track: infrastructure. Level: advanced. The talk will be recorded.",
        _object(title=_s(80), speaker=_s(40), company=_s(40), date=_DATE, start=_TIME,
                end=_TIME, track=_s(30), recorded=_BOOL),
        {"title": "Scaling Search at Low Latency", "speaker": "Tomasz Wilk",
         "company": "Quarry Systems", "date": "2025-10-09", "start": "10:30", "end": "11:15",
         "track": "infrastructure", "recorded": True}),
    _task(
        "purchase-order",
        "Extract the purchase order.",
        "PO 7781 for Cedar & Stone Builders: 120 bags of cement at 9.40 each, delivery to "
        "the Elm Street site by 2025-06-30. Shipping is express. Approved by J. Moreau.",
        _object(po_number=_s(12), buyer=_s(), item=_s(40), quantity=_int(1, 1_000_000),
                unit_price=_num(0, 100_000), delivery_date=_DATE,
                shipping=_enum("standard", "express"), approved_by=_s(40)),
        {"po_number": "7781", "buyer": "Cedar & Stone Builders", "item": "bags of cement",
         "quantity": 120, "unit_price": 9.4, "delivery_date": "2025-06-30",
         "shipping": "express", "approved_by": "J. Moreau"}),
)

#: The calibration tasks: for anything that is tuned on this dataset; never reported.
CALIBRATION_TASKS: tuple[JsonTask, ...] = (
    _task(
        "contact",
        "Extract the contact details.",
        "Hi team, please reach out to Maria Gonzalez, Senior Procurement Manager at Northwind "
        "Traders. Her email is maria.gonzalez@northwind.example and her direct line is "
        "+1 415 555 0132. She prefers email.",
        _object(name=_s(40), title=_s(), company=_s(), email=_s(), phone=_s(20),
                preferred_contact=_enum("email", "phone")),
        {"name": "Maria Gonzalez", "title": "Senior Procurement Manager",
         "company": "Northwind Traders", "email": "maria.gonzalez@northwind.example",
         "phone": "+1 415 555 0132", "preferred_contact": "email"}),
    _task(
        "restaurant-review",
        "Extract the review.",
        "We tried Casa Lumbre last Friday. The grilled octopus and the saffron rice were "
        "superb, service was slow though. Around 60 euros per person. Four stars out of five; "
        "I would go back.",
        _object(restaurant=_s(40), dishes=_strings(6, 30), rating=_int(1, 5),
                price_per_person=_num(0, 10_000), would_return=_BOOL,
                complaint=_s(60)),
        {"restaurant": "Casa Lumbre", "dishes": ["grilled octopus", "saffron rice"],
         "rating": 4, "price_per_person": 60, "would_return": True,
         "complaint": "slow service"}),
    _task(
        "package-tracking",
        "Extract the shipment status.",
        "Tracking 1Z84A90E0312: your parcel left the Memphis hub and is out for delivery. "
        "Expected today, 2025-04-11, before 18:00. Weight 2.3 kg. A signature is required.",
        _object(tracking_number=_s(20),
                status=_enum("in transit", "out for delivery", "delivered", "exception"),
                last_location=_s(40), expected_date=_DATE, weight_kg=_num(0, 1000),
                signature_required=_BOOL),
        {"tracking_number": "1Z84A90E0312", "status": "out for delivery",
         "last_location": "Memphis hub", "expected_date": "2025-04-11", "weight_kg": 2.3,
         "signature_required": True}),
    _task(
        "book",
        "Extract the book record.",
        "\"Salt and Signal\" by Odile Marchetti, published by Lanternfield Press in 2021, "
        "352 pages, ISBN 978-1-9998-2210-4. Genres: historical fiction, mystery. Available as "
        "an ebook.",
        _object(title=_s(), author=_s(40), publisher=_s(40), year=_int(1400, 2030),
                pages=_int(1, 10_000), isbn=_s(20), genres=_strings(4, 30), ebook=_BOOL),
        {"title": "Salt and Signal", "author": "Odile Marchetti",
         "publisher": "Lanternfield Press", "year": 2021, "pages": 352,
         "isbn": "978-1-9998-2210-4", "genres": ["historical fiction", "mystery"],
         "ebook": True}),
)
