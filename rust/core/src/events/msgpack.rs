//! A minimal zero-copy MessagePack reader: just what the KV-event decoder needs.
//! Every read is bounds-checked and reports the byte offset, so bad input is an error, never a panic.

/// What went wrong at the msgpack level; the decoder adds the field path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RawError {
    Truncated,
    /// Expected a kind of value, found a marker of another kind.
    Type {
        expected: &'static str,
        found: &'static str,
    },
    TooDeep,
    Reserved,
}

/// Nesting beyond this is refused (keeps skipping iterative-safe and bounded).
const MAX_DEPTH: usize = 64;

pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pub(crate) pos: usize,
}

/// A decoded integer: msgpack keeps the sign in the marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Int {
    U(u64),
    I(i64),
}

/// Names a marker byte for error messages.
pub(crate) fn kind_name(m: u8) -> &'static str {
    match m {
        0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3 => "int",
        0x80..=0x8f | 0xde | 0xdf => "map",
        0x90..=0x9f | 0xdc | 0xdd => "array",
        0xa0..=0xbf | 0xd9..=0xdb => "str",
        0xc0 => "nil",
        0xc2 | 0xc3 => "bool",
        0xc4..=0xc6 => "bin",
        0xca | 0xcb => "float",
        0xc7..=0xc9 | 0xd4..=0xd8 => "ext",
        0xc1 => "reserved byte 0xc1",
    }
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// The bytes read since position `start`.
    pub(crate) fn since(&self, start: usize) -> &'a [u8] {
        &self.buf[start.min(self.pos)..self.pos]
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.pos >= self.buf.len()
    }

    #[inline]
    pub(crate) fn peek(&self) -> Result<u8, RawError> {
        self.buf.get(self.pos).copied().ok_or(RawError::Truncated)
    }

    #[inline]
    fn byte(&mut self) -> Result<u8, RawError> {
        let b = self.peek()?;
        self.pos += 1;
        Ok(b)
    }

    #[inline]
    fn take(&mut self, n: usize) -> Result<&'a [u8], RawError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or(RawError::Truncated)?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    #[inline]
    fn be(&mut self, n: usize) -> Result<u64, RawError> {
        let s = self.take(n)?;
        Ok(s.iter().fold(0u64, |acc, &b| (acc << 8) | b as u64))
    }

    fn mismatch(&self, expected: &'static str) -> RawError {
        match self.peek() {
            Ok(m) => RawError::Type { expected, found: kind_name(m) },
            Err(e) => e,
        }
    }

    /// Consumes a nil if one is next.
    #[inline]
    pub(crate) fn nil(&mut self) -> Result<bool, RawError> {
        if self.peek()? == 0xc0 {
            self.pos += 1;
            return Ok(true);
        }
        Ok(false)
    }

    pub(crate) fn array_len(&mut self) -> Result<usize, RawError> {
        let m = self.peek()?;
        let n = match m {
            0x90..=0x9f => {
                self.pos += 1;
                (m & 0x0f) as usize
            }
            0xdc => {
                self.pos += 1;
                self.be(2)? as usize
            }
            0xdd => {
                self.pos += 1;
                self.be(4)? as usize
            }
            _ => return Err(self.mismatch("array")),
        };
        Ok(n)
    }

    pub(crate) fn map_len(&mut self) -> Result<usize, RawError> {
        let m = self.peek()?;
        let n = match m {
            0x80..=0x8f => {
                self.pos += 1;
                (m & 0x0f) as usize
            }
            0xde => {
                self.pos += 1;
                self.be(2)? as usize
            }
            0xdf => {
                self.pos += 1;
                self.be(4)? as usize
            }
            _ => return Err(self.mismatch("map")),
        };
        Ok(n)
    }

    pub(crate) fn str(&mut self) -> Result<&'a [u8], RawError> {
        let m = self.peek()?;
        let n = match m {
            0xa0..=0xbf => {
                self.pos += 1;
                (m & 0x1f) as usize
            }
            0xd9 => {
                self.pos += 1;
                self.be(1)? as usize
            }
            0xda => {
                self.pos += 1;
                self.be(2)? as usize
            }
            0xdb => {
                self.pos += 1;
                self.be(4)? as usize
            }
            _ => return Err(self.mismatch("str")),
        };
        self.take(n)
    }

    pub(crate) fn bin(&mut self) -> Result<&'a [u8], RawError> {
        let m = self.peek()?;
        let len_bytes = match m {
            0xc4 => 1,
            0xc5 => 2,
            0xc6 => 4,
            _ => return Err(self.mismatch("bin")),
        };
        self.pos += 1;
        let n = self.be(len_bytes)? as usize;
        self.take(n)
    }

    #[inline]
    pub(crate) fn int(&mut self) -> Result<Int, RawError> {
        let m = self.peek()?;
        let v = match m {
            0x00..=0x7f => {
                self.pos += 1;
                Int::U(m as u64)
            }
            0xe0..=0xff => {
                self.pos += 1;
                Int::I(m as i8 as i64)
            }
            0xcc..=0xcf => {
                self.pos += 1;
                Int::U(self.be(1 << (m - 0xcc))?)
            }
            0xd0..=0xd3 => {
                self.pos += 1;
                let n = 1usize << (m - 0xd0);
                let raw = self.be(n)?;
                let shift = 64 - 8 * n as u32;
                Int::I(((raw << shift) as i64) >> shift)
            }
            _ => return Err(self.mismatch("int")),
        };
        Ok(v)
    }

    /// Appends `n` unsigned ints that fit u32 (token ids) to `out`. On failure returns the index
    /// of the bad element, with the reader left at it, so the caller can name it.
    #[inline]
    pub(crate) fn u32s(&mut self, n: usize, out: &mut Vec<u32>) -> Result<(), usize> {
        let buf = self.buf;
        let mut pos = self.pos;
        for j in 0..n {
            // Token ids are almost always fixints or uint16/uint32: decode those inline.
            let v = match buf.get(pos) {
                Some(&m @ 0x00..=0x7f) => {
                    pos += 1;
                    m as u32
                }
                Some(0xcc) if pos + 1 < buf.len() => {
                    pos += 2;
                    buf[pos - 1] as u32
                }
                Some(0xcd) if pos + 2 < buf.len() => {
                    pos += 3;
                    u16::from_be_bytes([buf[pos - 2], buf[pos - 1]]) as u32
                }
                Some(0xce) if pos + 4 < buf.len() => {
                    pos += 5;
                    u32::from_be_bytes([buf[pos - 4], buf[pos - 3], buf[pos - 2], buf[pos - 1]])
                }
                _ => {
                    self.pos = pos;
                    return Err(j);
                }
            };
            out.push(v);
        }
        self.pos = pos;
        Ok(())
    }

    /// A float or an int, as f64 (timestamps).
    pub(crate) fn number(&mut self) -> Result<f64, RawError> {
        match self.peek()? {
            0xca => {
                self.pos += 1;
                Ok(f32::from_bits(self.be(4)? as u32) as f64)
            }
            0xcb => {
                self.pos += 1;
                Ok(f64::from_bits(self.be(8)?))
            }
            _ => match self.int() {
                Ok(Int::U(u)) => Ok(u as f64),
                Ok(Int::I(i)) => Ok(i as f64),
                Err(RawError::Type { found, .. }) => Err(RawError::Type { expected: "float", found }),
                Err(e) => Err(e),
            },
        }
    }

    /// Skips one value of any kind (nested up to `MAX_DEPTH`).
    pub(crate) fn skip(&mut self) -> Result<(), RawError> {
        // Number of values still to skip, per open container; iterative so depth never
        // touches the call stack.
        let mut pending: [usize; MAX_DEPTH] = [0; MAX_DEPTH];
        let mut depth = 0usize;
        pending[0] = 1;
        loop {
            if pending[depth] == 0 {
                if depth == 0 {
                    return Ok(());
                }
                depth -= 1;
                continue;
            }
            pending[depth] -= 1;
            let m = self.byte()?;
            let children = match m {
                0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => 0,
                0x80..=0x8f => 2 * (m & 0x0f) as usize,
                0x90..=0x9f => (m & 0x0f) as usize,
                0xa0..=0xbf => {
                    self.take((m & 0x1f) as usize)?;
                    0
                }
                0xc4 | 0xd9 => {
                    let n = self.be(1)? as usize;
                    self.take(n)?;
                    0
                }
                0xc5 | 0xda => {
                    let n = self.be(2)? as usize;
                    self.take(n)?;
                    0
                }
                0xc6 | 0xdb => {
                    let n = self.be(4)? as usize;
                    self.take(n)?;
                    0
                }
                0xc7 => {
                    let n = self.be(1)? as usize;
                    self.take(n + 1)?;
                    0
                }
                0xc8 => {
                    let n = self.be(2)? as usize;
                    self.take(n + 1)?;
                    0
                }
                0xc9 => {
                    let n = self.be(4)? as usize;
                    self.take(n + 1)?;
                    0
                }
                0xca => {
                    self.take(4)?;
                    0
                }
                0xcb => {
                    self.take(8)?;
                    0
                }
                0xcc..=0xcf => {
                    self.take(1 << (m - 0xcc))?;
                    0
                }
                0xd0..=0xd3 => {
                    self.take(1 << (m - 0xd0))?;
                    0
                }
                0xd4..=0xd8 => {
                    self.take(1 + (1 << (m - 0xd4)))?;
                    0
                }
                0xdc => self.be(2)? as usize,
                0xdd => self.be(4)? as usize,
                0xde => 2 * self.be(2)? as usize,
                0xdf => 2 * self.be(4)? as usize,
                0xc1 => return Err(RawError::Reserved),
            };
            if children > 0 {
                // Each child needs at least one byte: a count beyond what is left is truncation,
                // caught here so a forged count cannot make us loop for long.
                if children > self.buf.len() - self.pos {
                    return Err(RawError::Truncated);
                }
                depth += 1;
                if depth >= MAX_DEPTH {
                    return Err(RawError::TooDeep);
                }
                pending[depth] = children;
            }
        }
    }
}
