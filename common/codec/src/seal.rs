//! AES-256-GCM for payloads: keys, key rings, and the per-stream sealer and opener.
//!
//! Nonces are never reused under one key: each side draws a random 8-byte prefix for each
//! stream it sends on (from the OS generator) and counts payloads in the remaining 4 bytes
//! (`counter << 1 | part`: part 0 authenticates the header, part 1 seals the data). A stream
//! that would wrap its counter is refused rather than reuse a nonce. Two streams collide
//! only if their random prefixes do (2^-64 per pair).
//!
//! The opener accepts one prefix per stream and each counter at most once, within a window of
//! [`REPLAY_WINDOW`] counters below the highest accepted (the anti-replay window of IPsec's
//! RFC 4303): a replayed payload, or one older than the window, is refused. The window lets a
//! host seal once for several servers: a request moved from a server that died to another
//! arrives there after later ones. State advances only after a payload authenticates.

use std::fmt;

use aes_gcm::aead::{AeadInOut, KeyInit};
use aes_gcm::{Aes256Gcm, Nonce, Tag};
use rand_core::{OsRng, RngCore};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use zeroize::Zeroizing;

use crate::error::CodecError;
use crate::pb::{Seal, SealedMessage};

/// Bytes of an AES-GCM tag.
pub const TAG_BYTES: usize = 16;
const PREFIX_BYTES: usize = 8;
const KEY_CHECK_BYTES: usize = 8;
/// How far below the highest counter accepted on a stream an unseen counter is still accepted:
/// a request stalled on a server that stopped, resent to another after `request_timeout`, is
/// behind by what the host sent meanwhile (8192: 270 requests a second over 30 s). A 1 KiB map
/// per stream.
pub const REPLAY_WINDOW: u32 = 8192;
/// Largest counter: `counter << 1 | 1` must fit in 32 bits.
const MAX_COUNTER: u32 = (u32::MAX >> 1) - 1;

/// Why key material or a key ring cannot be used. Never contains the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// 64 characters that are not all hex digits.
    #[error("the key has 64 characters but they are not all hex digits")]
    NotHex,
    /// Neither 64 hex digits nor 32 raw bytes.
    #[error("a key is 64 hex digits or 32 raw bytes; this one has {bytes} bytes (make one with `head -c 32 /dev/urandom | xxd -p -c 64`)")]
    Length {
        /// The material's length.
        bytes: usize,
    },
    /// Two keys of a ring with the same id.
    #[error("key id {id} is given twice")]
    DuplicateId {
        /// The id.
        id: u32,
    },
}

/// A 256-bit key. Never printed: `Debug` shows only its id-free fingerprint's absence.
#[derive(Clone)]
pub struct Key(Zeroizing<[u8; 32]>);

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Key(<redacted>)")
    }
}

impl Key {
    /// From 32 bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(Zeroizing::new(bytes))
    }

    /// From the text of a key file or variable: 64 hex digits (surrounding whitespace
    /// ignored), or exactly 32 raw bytes. The error never contains the input.
    pub fn parse(material: &[u8]) -> Result<Self, KeyError> {
        let text = std::str::from_utf8(material).map(str::trim);
        if let Ok(text) = text {
            if text.len() == 64 {
                let mut bytes = Zeroizing::new([0u8; 32]);
                return hex::decode_to_slice(text, &mut bytes[..]).map(|()| Self(bytes)).map_err(|_| KeyError::NotHex);
            }
        }
        if material.len() == 32 {
            let mut bytes = Zeroizing::new([0u8; 32]);
            bytes.copy_from_slice(material);
            return Ok(Self(bytes));
        }
        Err(KeyError::Length { bytes: material.len() })
    }

    /// A fresh random key (tests, dev set-up).
    pub fn random() -> Self {
        let mut bytes = Zeroizing::new([0u8; 32]);
        OsRng.fill_bytes(&mut bytes[..]);
        Self(bytes)
    }

    /// The key as 64 hex digits, for writing a new key file.
    pub fn to_hex(&self) -> Zeroizing<String> {
        Zeroizing::new(hex::encode(&self.0[..]))
    }

    fn check_value(&self) -> [u8; KEY_CHECK_BYTES] {
        let digest = Sha256::new().chain_update(b"cleave key check v1").chain_update(&self.0[..]).finalize();
        digest[..KEY_CHECK_BYTES].try_into().expect("8 bytes")
    }
}

/// One key with its id, ready to use.
#[derive(Clone)]
struct RingKey {
    id: u32,
    check: [u8; KEY_CHECK_BYTES],
    cipher: Aes256Gcm,
}

/// The keys a side holds, by id (a server holds the current and the previous key while
/// hosts move to a new one).
#[derive(Clone, Default)]
pub struct KeyRing {
    keys: Vec<RingKey>,
}

impl fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyRing(ids {:?})", self.ids())
    }
}

impl KeyRing {
    /// A ring of `(id, key)` pairs; ids must be distinct.
    pub fn new(keys: impl IntoIterator<Item = (u32, Key)>) -> Result<Self, KeyError> {
        let mut ring = Self::default();
        for (id, key) in keys {
            if ring.ids().contains(&id) {
                return Err(KeyError::DuplicateId { id });
            }
            let cipher = Aes256Gcm::new_from_slice(&key.0[..]).expect("32-byte key");
            ring.keys.push(RingKey { id, check: key.check_value(), cipher });
        }
        Ok(ring)
    }

    /// The ids held.
    pub fn ids(&self) -> Vec<u32> {
        self.keys.iter().map(|k| k.id).collect()
    }

    /// Whether the ring holds no key.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    fn get(&self, id: u32) -> Option<&RingKey> {
        self.keys.iter().find(|k| k.id == id)
    }

    /// A sealer for one stream, with key `id` and a fresh random nonce prefix.
    pub fn sealer(&self, id: u32) -> Result<Sealer, CodecError> {
        let key = self.get(id).ok_or_else(|| CodecError::UnknownKeyId { id, held: self.ids() })?.clone();
        let mut prefix = [0u8; PREFIX_BYTES];
        OsRng.fill_bytes(&mut prefix);
        Ok(Sealer { key, prefix, next: 0 })
    }

    /// An opener for one stream.
    pub fn opener(&self) -> Opener {
        Opener { ring: self.clone(), prefix: None, seen: SeenCounters::default() }
    }
}

fn nonce(prefix: &[u8; PREFIX_BYTES], counter: u32, part: u32) -> Nonce<aes_gcm::aead::consts::U12> {
    let mut n = [0u8; 12];
    n[..PREFIX_BYTES].copy_from_slice(prefix);
    n[PREFIX_BYTES..].copy_from_slice(&((counter << 1) | part).to_be_bytes());
    Nonce::from(n)
}

/// Seals the payloads one side sends on one stream.
pub struct Sealer {
    key: RingKey,
    prefix: [u8; PREFIX_BYTES],
    next: u32,
}

impl fmt::Debug for Sealer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Sealer(key id {}, next counter {})", self.key.id, self.next)
    }
}

impl Sealer {
    /// The key id it seals with.
    pub fn key_id(&self) -> u32 {
        self.key.id
    }

    /// Takes the next counter; the `Seal` goes into the envelope.
    pub(crate) fn next_seal(&mut self) -> Result<Seal, CodecError> {
        if self.next > MAX_COUNTER {
            return Err(CodecError::NoncesExhausted);
        }
        let counter = self.next;
        self.next += 1;
        Ok(Seal { key_id: self.key.id, key_check: self.key.check.to_vec(), nonce_prefix: self.prefix.to_vec(), counter })
    }

    /// Tag over the header bytes (part 0), then encrypts `data` in place and appends its tag
    /// (part 1). Returns the header tag.
    pub(crate) fn seal(&self, seal: &Seal, header: &[u8], data: &mut Vec<u8>) -> Result<Vec<u8>, CodecError> {
        let cipher = &self.key.cipher;
        let header_tag = cipher
            .encrypt_inout_detached(&nonce(&self.prefix, seal.counter, 0), header, (&mut [][..]).into())
            .map_err(|_| CodecError::Seal("header".into()))?;
        let data_tag = cipher
            .encrypt_inout_detached(&nonce(&self.prefix, seal.counter, 1), &[], data.as_mut_slice().into())
            .map_err(|_| CodecError::Seal("data too long for AES-GCM".into()))?;
        data.extend_from_slice(&data_tag);
        Ok(header_tag.to_vec())
    }
}

impl Sealer {
    /// Seals `message` whole (a serialised protobuf message) as the next on the stream, with
    /// `kind` (the message's name) authenticated beside it.
    pub fn seal_message(&mut self, kind: &str, mut message: Vec<u8>) -> Result<SealedMessage, CodecError> {
        let seal = self.next_seal()?;
        let kind_tag = self.seal(&seal, kind.as_bytes(), &mut message)?;
        Ok(SealedMessage { seal: Some(seal), kind_tag, data: message })
    }
}

/// Checks and opens the payloads one side receives on one stream.
pub struct Opener {
    ring: KeyRing,
    prefix: Option<[u8; PREFIX_BYTES]>,
    seen: SeenCounters,
}

impl fmt::Debug for Opener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Opener(ids {:?}, highest counter {:?})", self.ring.ids(), self.seen.highest)
    }
}

impl Opener {
    /// Whether this side holds any key.
    pub fn has_keys(&self) -> bool {
        !self.ring.is_empty()
    }

    /// Opens a [`Sealer::seal_message`]'s message: the serialised message, once its key,
    /// its place in the stream's nonce sequence, its `kind` and its bytes are checked.
    pub fn open_message(&mut self, kind: &str, sealed: SealedMessage) -> Result<Vec<u8>, CodecError> {
        let seal = sealed.seal.ok_or(CodecError::NotSealed)?;
        if !self.has_keys() {
            return Err(CodecError::NoKeys { id: seal.key_id });
        }
        self.check_header(&seal, kind.as_bytes(), &sealed.kind_tag)?;
        let mut data = sealed.data;
        self.open_in_place(&seal, &mut data)?;
        data.truncate(data.len() - TAG_BYTES);
        Ok(data)
    }

    /// Checks the key, the nonce order and the header's tag, before anything is allocated
    /// for the data.
    pub(crate) fn check_header(&self, seal: &Seal, header: &[u8], header_tag: &[u8]) -> Result<(), CodecError> {
        let key = self.ring.get(seal.key_id).ok_or_else(|| CodecError::UnknownKeyId { id: seal.key_id, held: self.ring.ids() })?;
        if !bool::from(key.check.ct_eq(&seal.key_check[..])) {
            return Err(CodecError::WrongKey { id: seal.key_id });
        }
        let prefix: [u8; PREFIX_BYTES] = seal.nonce_prefix.as_slice().try_into().map_err(|_| CodecError::NoncePrefix(seal.nonce_prefix.len()))?;
        if self.prefix.is_some_and(|p| p != prefix) {
            return Err(CodecError::Replayed { detail: "the nonce prefix changed within the stream".into() });
        }
        if seal.counter > MAX_COUNTER {
            return Err(CodecError::Counter(seal.counter));
        }
        self.seen.check(seal.counter)?;
        let tag: [u8; TAG_BYTES] = header_tag.try_into().map_err(|_| CodecError::HeaderTampered)?;
        key.cipher
            .decrypt_inout_detached(&nonce(&prefix, seal.counter, 0), header, (&mut [][..]).into(), &Tag::from(tag))
            .map_err(|_| CodecError::HeaderTampered)
    }

    /// Decrypts `data` (ciphertext then tag) in place after [`Opener::check_header`]
    /// passed, leaving the tag as it is; on success the stream's nonce state moves past this
    /// payload.
    pub(crate) fn open_in_place(&mut self, seal: &Seal, data: &mut [u8]) -> Result<(), CodecError> {
        let body = data.len().checked_sub(TAG_BYTES).ok_or(CodecError::DataTampered)?;
        let (body, tag) = data.split_at_mut(body);
        self.open_detached(seal, body, tag)
    }

    /// Decrypts the ciphertext `body` in place with its `tag` kept apart (a tensor's memory
    /// holds the ciphertext, say); otherwise as [`Opener::open_in_place`].
    pub(crate) fn open_detached(&mut self, seal: &Seal, body: &mut [u8], tag: &[u8]) -> Result<(), CodecError> {
        let key = self.ring.get(seal.key_id).ok_or_else(|| CodecError::UnknownKeyId { id: seal.key_id, held: self.ring.ids() })?;
        let prefix: [u8; PREFIX_BYTES] = seal.nonce_prefix.as_slice().try_into().map_err(|_| CodecError::NoncePrefix(seal.nonce_prefix.len()))?;
        let tag: [u8; TAG_BYTES] = tag.try_into().map_err(|_| CodecError::DataTampered)?;
        // Checked again: another payload may have been opened since this one's header was.
        self.seen.check(seal.counter)?;
        key.cipher
            .decrypt_inout_detached(&nonce(&prefix, seal.counter, 1), &[], body.into(), &Tag::from(tag))
            .map_err(|_| CodecError::DataTampered)?;
        self.prefix = Some(prefix);
        self.seen.accept(seal.counter);
        Ok(())
    }
}

/// The counters accepted on a stream: the highest, and which of the [`REPLAY_WINDOW`] below
/// it were (bit `i` of the map: counter `highest - i`).
struct SeenCounters {
    highest: Option<u32>,
    map: Box<[u64; (REPLAY_WINDOW / 64) as usize]>,
}

impl Default for SeenCounters {
    fn default() -> Self {
        Self { highest: None, map: Box::new([0; (REPLAY_WINDOW / 64) as usize]) }
    }
}

impl SeenCounters {
    fn check(&self, counter: u32) -> Result<(), CodecError> {
        let Some(highest) = self.highest else { return Ok(()) };
        let replayed = |why: String| Err(CodecError::Replayed { detail: format!("counter {counter} {why}") });
        match highest.checked_sub(counter) {
            None => Ok(()),
            Some(behind) if behind >= REPLAY_WINDOW => replayed(format!("is {behind} behind counter {highest}, past the window of {REPLAY_WINDOW}")),
            Some(behind) if self.bit(behind) => replayed("was accepted before".into()),
            Some(_) => Ok(()),
        }
    }

    /// Marks `counter` seen (one [`SeenCounters::check`] passed); one past the window is
    /// left alone.
    fn accept(&mut self, counter: u32) {
        let highest = self.highest.unwrap_or(counter);
        if counter > highest || self.highest.is_none() {
            let ahead = counter - highest;
            self.shift(ahead);
            self.highest = Some(counter);
            self.set(0);
        } else if highest - counter < REPLAY_WINDOW {
            self.set(highest - counter);
        }
    }

    fn bit(&self, behind: u32) -> bool {
        self.map[(behind / 64) as usize] >> (behind % 64) & 1 == 1
    }

    fn set(&mut self, behind: u32) {
        self.map[(behind / 64) as usize] |= 1 << (behind % 64);
    }

    /// Moves every bit `by` counters further behind; those past the window drop out.
    fn shift(&mut self, by: u32) {
        let (words, bits) = ((by / 64) as usize, by % 64);
        let map = &mut self.map;
        // From the far end down: each word reads only words below it, not yet moved.
        for i in (0..map.len()).rev() {
            let from = |j: Option<usize>| j.map_or(0, |j| map[j]);
            let whole = from(i.checked_sub(words));
            let carried = if bits == 0 { 0 } else { from(i.checked_sub(words + 1)) >> (64 - bits) };
            map[i] = if bits == 0 { whole } else { whole << bits | carried };
        }
    }
}
