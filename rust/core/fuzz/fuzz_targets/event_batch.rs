//! Fuzzes the KV-event decoder and applier: any bytes must give Ok or a typed error, never a panic
//! or a hang, and a rejected batch must leave the index exactly as it was.
#![no_main]

use kvroute_core::KvIndex;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let idx = KvIndex::new(Some(10_000));
    // Two batches from one input: whatever the first leaves (parents, engine hashes) the second can hit.
    let (first, second) = data.split_at(data.len() / 2);
    let _ = idx.apply_event_batch(1, first, 4, 1337);
    let before = idx.dump();
    if idx.apply_event_batch(1, second, 4, 1337).is_err() {
        assert_eq!(idx.dump(), before, "a rejected batch changed the index");
    }
});
