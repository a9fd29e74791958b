package PVE::Storage::Custom::FewerbytesPlugin;

# A Proxmox VE storage of type `fewerbytes`: VM disks as volumes of a fewerbytes pool,
# served over NBD by `fewerbytes serve` (the fewerbytes@NAME service).
#
# Every operation runs the `fewerbytes` command with --require-server, so it reaches
# the running server through its control socket and never opens the pool itself; QEMU
# opens each disk as the NBD export of its volume (`path` returns the URI, pve-storage
# turns it into an `nbd` blockdev). docs/proxmox.md says what each action does to the
# pool and what is refused.
#
# Names: a Proxmox volume name is the pool volume's name, except that a linked clone's
# volume name `base-100-disk-0/vm-101-disk-0` (its template, then itself, as Proxmox
# wants it) is stored as `base-100-disk-0+vm-101-disk-0`: a pool volume name has no
# `/`, and the template's name must survive in the pool for Proxmox to refuse deleting
# a template that clones still name. A snapshot SNAP of a volume is the pool's own
# snapshot `VOLUME@SNAP` (read-only, served read-only as an NBD export of that name,
# with an identity that a send stream carries to another pool). Older versions of
# this plugin made a clone `snap:SNAP:VOLUME` instead: those are still found, rolled
# back to, deleted and migrated, so an upgrade loses none.
#
# A pool on a Ceph RBD image (`rbd:POOL/IMAGE[@CLUSTER]`) is reachable from every node,
# so such a storage is `shared` (set when it is added); one node serves it at a time
# (docs/proxmox.md, "A pool on RBD: shared storage"). It has no directory to keep
# sockets beside, so its storage must name the sockets of the server that serves it.

use strict;
use warnings;

use JSON;
use POSIX qw(ceil);

use PVE::Tools qw(run_command);
use PVE::Storage::Plugin;

use base qw(PVE::Storage::Plugin);

# The binary the install script puts in place; the tests point this at their build.
our $FEWERBYTES = '/usr/local/bin/fewerbytes';

# A volume's size must be a multiple of the pool's 4 KiB block.
my $BLOCK_BYTES = 4096;

# How long one management command may take: volume commands take a checkpoint, and
# `volume list` walks every block map.
my $COMMAND_TIMEOUT_S = 120;

# What the plugin was written and tested against: pve-storage's storage API 15
# (APIAGE 6, so hosts from API 9 on load it). On an older host, claim its version: the
# methods used here exist since API 10 (rename_volume), and a newer API only adds.
my $API_TESTED = 15;
my $API_MIN = 10;

sub api {
    # Looked up when called: PVE::Storage loads this plugin, so it may not be compiled
    # yet when this file is.
    my $apiver = PVE::Storage->can('APIVER');
    my $host = $apiver ? $apiver->() : $API_TESTED;
    return $API_TESTED if $host >= $API_TESTED;
    return $host >= $API_MIN ? $host : $API_TESTED;
}

sub type {
    return 'fewerbytes';
}

sub plugindata {
    return {
        # Disk images only. Containers (rootdir) need a block device or a file system on
        # the host, and a volume here is an NBD export that only QEMU opens.
        content => [{ images => 1 }, { images => 1 }],
        format => [{ raw => 1 }, 'raw'],
    };
}

sub properties {
    return {
        'fewerbytes-pool' => {
            description => "The fewerbytes pool (file, block device or rbd:POOL/IMAGE"
                . " image) this storage keeps its disks in, as the server was started with.",
            type => 'string',
        },
        'fewerbytes-socket' => {
            description => "The server's NBD unix socket (default: <pool>.sock, for a pool"
                . " file; /run/fewerbytes/NAME.sock for the fewerbytes\@NAME service;"
                . " required for a pool on RBD).",
            type => 'string',
        },
        'fewerbytes-control-socket' => {
            description => "The server's control socket (default: <pool>.ctl, for a pool"
                . " file; /run/fewerbytes/NAME.ctl for the fewerbytes\@NAME service;"
                . " required for a pool on RBD).",
            type => 'string',
        },
    };
}

sub options {
    return {
        'fewerbytes-pool' => { fixed => 1 },
        'fewerbytes-socket' => { optional => 1 },
        'fewerbytes-control-socket' => { optional => 1 },
        nodes => { optional => 1 },
        shared => { optional => 1 },
        disable => { optional => 1 },
        content => { optional => 1 },
        bwlimit => { optional => 1 },
    };
}

# ---------------------------------------------------------------------------------
# Talking to the server

# Whether the pool is on a Ceph RBD image (`rbd:POOL/IMAGE[@CLUSTER]`, the scheme as
# the fewerbytes CLI reads it): every node of the cluster can reach it.
my sub is_rbd_pool {
    my ($scfg) = @_;
    return ($scfg->{'fewerbytes-pool'} // '') =~ m/^rbd:/ ? 1 : 0;
}

# The sockets of a pool on RBD are where its server was told to put them: the CLI's
# own default, /run/fewerbytes/<pool id>.*, is not what the fewerbytes@NAME service
# uses, and there is no directory beside an image. So they must be named: the
# sentence saying so, or undef when they are (or the pool is a file).
my sub rbd_sockets_missing {
    my ($scfg) = @_;
    return undef if !is_rbd_pool($scfg);
    my @missing = grep { ($scfg->{$_} // '') eq '' } qw(fewerbytes-socket fewerbytes-control-socket);
    return undef if !@missing;
    return "pool $scfg->{'fewerbytes-pool'} is on RBD, with no directory to find its"
        . " server's sockets in: set " . join(' and ', @missing) . " (for the"
        . " fewerbytes\@NAME service that serves it: /run/fewerbytes/NAME.sock and"
        . " /run/fewerbytes/NAME.ctl)\n";
}

my sub control_socket {
    my ($scfg) = @_;
    if (my $missing = rbd_sockets_missing($scfg)) {
        die $missing;
    }
    return $scfg->{'fewerbytes-control-socket'} // "$scfg->{'fewerbytes-pool'}.ctl";
}

my sub nbd_socket {
    my ($scfg) = @_;
    if (my $missing = rbd_sockets_missing($scfg)) {
        die $missing;
    }
    return $scfg->{'fewerbytes-socket'} // "$scfg->{'fewerbytes-pool'}.sock";
}

# Run `fewerbytes ARGS` against the storage's served pool; returns its stdout. Dies
# with the command's own sentence (it names the volume, the numbers, the reason).
my sub fewerbytes {
    my ($scfg, @args) = @_;
    die "storage has no fewerbytes-pool\n" if !$scfg->{'fewerbytes-pool'};
    my $cmd = [
        $FEWERBYTES,
        '--pool', $scfg->{'fewerbytes-pool'},
        '--control-socket', control_socket($scfg),
        '--require-server',
        @args,
    ];
    my ($out, $err) = ('', '');
    eval {
        run_command(
            $cmd,
            outfunc => sub { $out .= "$_[0]\n" },
            errfunc => sub { $err .= "$_[0]\n" },
            timeout => $COMMAND_TIMEOUT_S,
        );
    };
    if (my $failed = $@) {
        # Under systemd the CLI prefixes errors with the journal's level (<3>).
        $err =~ s/^<\d>//mg;
        $err =~ s/^fewerbytes: error: //mg;
        $err =~ s/\s+\z//;
        die $err ne '' ? "$err\n" : $failed;
    }
    return $out;
}

my sub fewerbytes_json {
    my ($scfg, @args) = @_;
    return decode_json(fewerbytes($scfg, @args, '--json'));
}

# Every pool volume, by pool name.
my sub pool_volumes {
    my ($scfg) = @_;
    return { map { $_->{name} => $_ } fewerbytes_json($scfg, 'volume', 'list')->@* };
}

# ---------------------------------------------------------------------------------
# Names

# A Proxmox snapshot's name in the pool. A pool name starts with a letter or a digit
# (a leading - would read as an option), and replication's `__replicate_JOB_TIME__`
# does not: such a name gets the prefix `p.`, which no Proxmox name can hold (it has
# no `.`), so the mapping goes both ways.
my sub pool_snap {
    my ($snap) = @_;
    return $snap =~ m/^[A-Za-z0-9]/ ? $snap : "p.$snap";
}

my sub pve_snap {
    my ($snap) = @_;
    return $snap =~ s/^p\.//r;
}

# The pool volume holding a Proxmox volume; with $snap, the name of its snapshot SNAP
# (`VOLUME@SNAP`), or with $legacy that of an older plugin's clone (`snap:SNAP:VOLUME`).
my sub pool_name {
    my ($volname, $snap, $legacy) = @_;
    my $name = $volname =~ s|/|+|r;
    return $name if !defined($snap);
    return $legacy ? "snap:$snap:$name" : "$name\@" . pool_snap($snap);
}

# The snapshots of pool volume $name, oldest first (a pool's volume ids grow): its
# own (`volume snapshot list`) and an older plugin's clones `snap:SNAP:NAME` (from
# $volumes, `volume list`, when given; else listed). Each: { snap, pool_name, id
# (the pool's volume id), legacy, guid, created }.
my sub snapshot_list {
    my ($scfg, $name, $volumes) = @_;
    $volumes //= { map { $_->{name} => $_ } fewerbytes_json($scfg, 'volume', 'list')->@* };
    my @snaps;
    # An older plugin's clones may outlive their disk (an import of them in progress).
    my $own = $volumes->{$name} ? fewerbytes_json($scfg, 'volume', 'snapshot', 'list', $name) : [];
    for my $snapshot (@$own) {
        my ($of, $snap) = split(/\@/, $snapshot->{name}, 2);
        die "volume snapshot list $name gave '$snapshot->{name}'\n"
            if $of ne $name || !defined($snap);
        push @snaps, {
            snap => pve_snap($snap),
            pool_name => $snapshot->{name},
            id => $snapshot->{id},
            guid => $snapshot->{guid} // die("snapshot '$snapshot->{name}' has no guid\n"),
            created => $snapshot->{created},
            legacy => 0,
        };
    }
    for my $pool_name (keys %$volumes) {
        next if $pool_name !~ m/^snap:([^:]+):\Q$name\E$/;
        push @snaps, { snap => $1, pool_name => $pool_name, id => $volumes->{$pool_name}->{id},
            legacy => 1 };
    }
    return sort { $a->{id} <=> $b->{id} } @snaps;
}

# The snapshot SNAP of Proxmox volume $volname as snapshot_list gives it, or undef.
my sub find_snapshot {
    my ($scfg, $volname, $snap) = @_;
    my ($found) = grep { $_->{snap} eq $snap } snapshot_list($scfg, pool_name($volname));
    return $found;
}

# The pool name of a snapshot for path and activation: the pool's snapshot unless
# only an older plugin's clone of that name exists.
my sub snapshot_pool_name {
    my ($scfg, $volname, $snap) = @_;
    my $found = find_snapshot($scfg, $volname, $snap);
    return $found ? $found->{pool_name} : pool_name($volname, $snap);
}

# The characters Proxmox may use in a disk name here: those of a pool volume name
# except `+` and `:`, which the plugin's own names use.
my $NAME_RE = qr/[A-Za-z0-9][A-Za-z0-9_.-]*/;

sub parse_volname {
    my ($class, $volname) = @_;

    if ($volname =~ m!^(?:(base-(\d+)-$NAME_RE)/)?((vm-|base-)(\d+)-$NAME_RE)$!) {
        my ($basename, $basevmid, $name, $prefix, $vmid) = ($1, $2, $3, $4, $5);
        my $is_base = $prefix eq 'base-' ? 1 : undef;
        return ('images', $name, $vmid, $basename, $basevmid, $is_base, 'raw');
    }
    die "unable to parse fewerbytes volume name '$volname'\n";
}

# The Proxmox volume name of a pool volume, or undef for what is not a disk here
# (snapshots, volumes made by hand).
my sub volname_of {
    my ($pool_name) = @_;
    return undef if $pool_name =~ /^snap:/;
    my $volname = $pool_name =~ s|\+|/|r;
    return eval { PVE::Storage::Custom::FewerbytesPlugin->parse_volname($volname); 1 }
        ? $volname
        : undef;
}

# The first free `vm-VMID-disk-N` among the pool's volumes.
my sub free_disk_name {
    my ($scfg, $storeid, $vmid, $volumes) = @_;
    my %taken;
    for my $pool_name (keys %$volumes) {
        my $volname = volname_of($pool_name) // next;
        my $name = (PVE::Storage::Custom::FewerbytesPlugin->parse_volname($volname))[1];
        $taken{$1} = 1 if $name =~ m/^(?:vm|base)-\Q$vmid\E-disk-(\d+)$/;
    }
    for my $n (0 .. 999) {
        return "vm-$vmid-disk-$n" if !$taken{$n};
    }
    die "unable to allocate a disk name for VM $vmid on storage '$storeid'\n";
}

# Bytes rounded up to the pool's block size.
my sub whole_blocks {
    my ($bytes) = @_;
    return ceil($bytes / $BLOCK_BYTES) * $BLOCK_BYTES;
}

# ---------------------------------------------------------------------------------
# Storage

sub on_add_hook {
    my ($class, $storeid, $scfg, %param) = @_;
    die "storage '$storeid': a fewerbytes storage holds VM disk images only; containers"
        . " (rootdir) need a block device or file system on the host, which an NBD"
        . " export served to QEMU is not\n"
        if $scfg->{content} && $scfg->{content}->{rootdir};
    if (my $missing = rbd_sockets_missing($scfg)) {
        die "storage '$storeid': $missing";
    }
    # A pool on RBD is the same pool from every node: Proxmox must know, to restart
    # or move a VM on another node without copying its disks. pve-storage stores the
    # options this hook is given, so the flag is kept in storage.cfg. A pool file
    # stays as the admin said (a block device shared by other means may be `shared`).
    $scfg->{shared} = 1 if is_rbd_pool($scfg);
    return undef;
}

# `pvesm set` (storage API 13 on: the current config, the changed options and the
# deleted ones). A pool on RBD keeps its sockets and stays shared.
sub on_update_hook_full {
    my ($class, $storeid, $scfg, $param, $delete, $sensitive) = @_;
    my %after = (%$scfg, %$param);
    delete $after{$_} for ($delete // [])->@*;
    return undef if !is_rbd_pool(\%after);
    if (my $missing = rbd_sockets_missing(\%after)) {
        die "storage '$storeid': $missing";
    }
    die "storage '$storeid': pool $after{'fewerbytes-pool'} is on RBD, the same pool from"
        . " every node: it stays shared\n"
        if !$after{shared};
    return undef;
}

sub status {
    my ($class, $storeid, $scfg, $cache) = @_;
    my $stats = eval { fewerbytes_json($scfg, 'stats') };
    if (my $err = $@) {
        warn "storage '$storeid': $err";
        return (0, 0, 0, 0);
    }
    # Disks made here are thick (alloc_image and clone_image run `volume create` and
    # `volume clone`, which reserve the disk's size), so what Proxmox may still put
    # here is what a new reservation can get: avail is the pool's Reservable, and
    # used the rest of its Size, so that used + avail = total as Proxmox adds them
    # (docs/proxmox.md). Stats' Available (what a thin write can take) is larger by
    # the reserve kept for trims and deletes and a new reservation's metadata pages.
    my $total = $stats->{size_bytes};
    my $avail = $stats->{reservable_bytes};
    die "fewerbytes stats --json gave no size_bytes or reservable_bytes\n"
        if !defined($total) || !defined($avail);
    return ($total, $avail, $total - $avail, 1);
}

sub activate_storage {
    my ($class, $storeid, $scfg, $cache) = @_;
    eval { fewerbytes($scfg, 'pool', 'info', '--json') };
    die "storage '$storeid' is not available: $@" if $@;
    return 1;
}

sub deactivate_storage {
    my ($class, $storeid, $scfg, $cache) = @_;
    return 1;
}

sub check_connection {
    my ($class, $storeid, $scfg) = @_;
    return eval { fewerbytes($scfg, 'pool', 'info', '--json'); 1 } ? 1 : 0;
}

# ---------------------------------------------------------------------------------
# Volumes

sub path {
    my ($class, $scfg, $volname, $storeid, $snapname) = @_;
    my ($vtype, undef, $vmid) = $class->parse_volname($volname);
    # A snapshot is served read-only under its full name.
    my $name = defined($snapname) ? snapshot_pool_name($scfg, $volname, $snapname)
        : pool_name($volname);
    my $path = 'nbd+unix:///' . $name . '?socket=' . nbd_socket($scfg);
    return wantarray ? ($path, $vmid, $vtype) : $path;
}

sub filesystem_path {
    my ($class, $scfg, $volname, $snapname) = @_;
    return $class->path($scfg, $volname, undef, $snapname);
}

sub map_volume {
    my ($class, $storeid, $scfg, $volname, $snapname, $hints) = @_;
    die "volume '$storeid:$volname' cannot be mapped to a block device on the host: a"
        . " fewerbytes volume is an NBD export that QEMU opens (containers, and TPM state,"
        . " which swtpm needs as a file, are not supported here)\n";
}

sub unmap_volume {
    my ($class, $storeid, $scfg, $volname, $snapname) = @_;
    return 1;
}

sub activate_volume {
    my ($class, $storeid, $scfg, $volname, $snapname, $cache, $hints) = @_;
    if (defined($snapname)) {
        die "snapshot '$snapname' of '$storeid:$volname' is not available\n"
            if !find_snapshot($scfg, $volname, $snapname);
        return 1;
    }
    eval { fewerbytes($scfg, 'volume', 'info', pool_name($volname), '--json') };
    die "volume '$storeid:$volname' is not available: $@" if $@;
    return 1;
}

sub deactivate_volume {
    my ($class, $storeid, $scfg, $volname, $snapname, $cache) = @_;
    return 1;
}

sub alloc_image {
    my ($class, $storeid, $scfg, $vmid, $fmt, $name, $size_kib) = @_;

    die "a fewerbytes storage holds raw disk images only, not '$fmt'"
        . ($fmt eq 'subvol' ? ' (containers are not supported)' : '') . "\n"
        if $fmt ne 'raw';
    die "illegal name '$name' - should be 'vm-$vmid-*'\n"
        if defined($name) && $name !~ m/^vm-\Q$vmid\E-$NAME_RE$/;
    die "a disk of size 0 cannot be created\n" if !$size_kib;

    $name //= free_disk_name($scfg, $storeid, $vmid, pool_volumes($scfg));
    fewerbytes($scfg, 'volume', 'create', $name, '--size', whole_blocks($size_kib * 1024));
    return $name;
}

sub free_image {
    my ($class, $storeid, $scfg, $volname, $is_base, $format) = @_;
    my $name = pool_name($volname);
    # Its snapshots go with it, as a file's internal snapshots would; the pool refuses
    # to delete a volume that has snapshots, so they go first. Not while a VM has the
    # disk open (the server counts its connections): that is refused before any goes.
    my $users = fewerbytes_json($scfg, 'volume', 'info', $name)->{users} // 0;
    die "volume '$storeid:$volname' is in use by $users client(s)\n" if $users;
    for my $snapshot (reverse snapshot_list($scfg, $name)) {
        if ($snapshot->{legacy}) {
            fewerbytes($scfg, 'volume', 'delete', $snapshot->{pool_name});
        } else {
            fewerbytes($scfg, 'volume', 'snapshot', 'delete', $name, pool_snap($snapshot->{snap}));
        }
    }
    fewerbytes($scfg, 'volume', 'delete', $name);
    return undef;
}

sub list_images {
    my ($class, $storeid, $scfg, $vmid, $vollist, $cache) = @_;
    my $volumes = pool_volumes($scfg);
    my %wanted = map { $_ => 1 } ($vollist // [])->@*;
    my $res = [];
    for my $pool_name (sort keys %$volumes) {
        my $volname = volname_of($pool_name) // next;
        my (undef, undef, $owner, $basename) = $class->parse_volname($volname);
        my $volid = "$storeid:$volname";
        if ($vollist) {
            next if !$wanted{$volid};
        } elsif (defined($vmid)) {
            next if $owner ne $vmid;
        }
        my $volume = $volumes->{$pool_name};
        push @$res,
            {
                volid => $volid,
                format => 'raw',
                size => $volume->{size_bytes},
                used => $volume->{logical_used_bytes},
                vmid => $owner,
                (defined($basename) ? (parent => $basename) : ()),
            };
    }
    return $res;
}

sub volume_size_info {
    my ($class, $scfg, $storeid, $volname, $timeout) = @_;
    my (undef, undef, undef, $basename) = $class->parse_volname($volname);
    my $volume = fewerbytes_json($scfg, 'volume', 'info', pool_name($volname));
    return $volume->{size_bytes} if !wantarray;
    return ($volume->{size_bytes}, 'raw', $volume->{logical_used_bytes}, $basename);
}

sub volume_resize {
    my ($class, $scfg, $storeid, $volname, $size, $running, $snapname) = @_;
    die "cannot resize '$storeid:$volname' while its VM runs: QEMU cannot resize an NBD"
        . " disk live; shut the VM down, resize, and start it again\n"
        if $running;
    die "cannot resize a snapshot of '$storeid:$volname'\n" if defined($snapname);
    fewerbytes($scfg, 'volume', 'resize', pool_name($volname), '--size', whole_blocks($size));
    return undef;
}

sub create_base {
    my ($class, $storeid, $scfg, $volname) = @_;
    my ($vtype, $name, $vmid, $basename, $basevmid, $is_base) = $class->parse_volname($volname);
    die "create_base not possible with base image\n" if $is_base;
    my $pool_name = pool_name($volname);
    die "cannot make a template of '$storeid:$volname' while it has snapshots: delete them"
        . " first\n"
        if scalar(my @snapshots = snapshot_list($scfg, $pool_name));

    (my $newname = $name) =~ s/^vm-/base-/;
    my $newvolname = defined($basename) ? "$basename/$newname" : $newname;
    fewerbytes($scfg, 'volume', 'rename', $pool_name, pool_name($newvolname));
    return $newvolname;
}

sub clone_image {
    my ($class, $scfg, $storeid, $volname, $vmid, $snap) = @_;
    my ($vtype, $name, undef, undef, undef, $is_base) = $class->parse_volname($volname);
    die "a linked clone of a snapshot is not supported on fewerbytes: make a full clone\n"
        if $snap;
    die "clone_image only works on base images\n" if !$is_base;

    my $newname = free_disk_name($scfg, $storeid, $vmid, pool_volumes($scfg));
    my $newvolname = "$name/$newname";
    fewerbytes($scfg, 'volume', 'clone', pool_name($volname), pool_name($newvolname));
    return $newvolname;
}

sub rename_volume {
    my ($class, $scfg, $storeid, $source_volname, $target_vmid, $target_volname) = @_;
    my (undef, undef, undef, $basename) = $class->parse_volname($source_volname);
    $target_volname //= free_disk_name($scfg, $storeid, $target_vmid, pool_volumes($scfg));
    die "illegal name '$target_volname' - should be 'vm-$target_vmid-*'\n"
        if $target_volname !~ m/^vm-\Q$target_vmid\E-$NAME_RE$/;
    my $target = defined($basename) ? "$basename/$target_volname" : $target_volname;
    fewerbytes($scfg, 'volume', 'rename', pool_name($source_volname), pool_name($target));
    return "$storeid:$target";
}

# ---------------------------------------------------------------------------------
# Snapshots: the pool's own (`volume snapshot`): O(1), sharing the volume's block-map
# pages, read-only, with an identity (guid) that send streams carry, so that two
# pools holding a replica name the same snapshot the same way. An older plugin's
# clones `snap:SNAP:VOLUME` are still rolled back to and deleted.

sub volume_snapshot {
    my ($class, $scfg, $storeid, $volname, $snap) = @_;
    fewerbytes($scfg, 'volume', 'snapshot', pool_name($volname), pool_snap($snap));
    return undef;
}

sub volume_snapshot_delete {
    my ($class, $scfg, $storeid, $volname, $snap, $running) = @_;
    my $found = find_snapshot($scfg, $volname, $snap)
        // die "snapshot '$snap' of '$storeid:$volname' does not exist\n";
    if ($found->{legacy}) {
        fewerbytes($scfg, 'volume', 'delete', $found->{pool_name});
    } else {
        fewerbytes($scfg, 'volume', 'snapshot', 'delete', pool_name($volname), pool_snap($snap));
    }
    return undef;
}

sub volume_snapshot_rollback {
    my ($class, $scfg, $storeid, $volname, $snap) = @_;
    my $found = find_snapshot($scfg, $volname, $snap)
        // die "snapshot '$snap' of '$storeid:$volname' does not exist\n";
    # One durable step (a crash leaves the disk as it was or as the snapshot), refused
    # while a VM has the disk open; the disk keeps its id and every snapshot.
    fewerbytes($scfg, 'volume', 'rollback', pool_name($volname),
        $found->{legacy} ? $found->{pool_name} : pool_snap($snap));
    return undef;
}

# For replication: each snapshot's identity, the same in every pool a send stream
# carried it to, and its creation time (on a receiving pool: when it arrived). An
# older plugin's clones have no identity shared with another pool: they are left out,
# so replication never takes one for a common base.
sub volume_snapshot_info {
    my ($class, $scfg, $storeid, $volname) = @_;
    my $name = pool_name($volname);
    return {} if !pool_volumes($scfg)->{$name};
    my $info = {};
    for my $snapshot (fewerbytes_json($scfg, 'volume', 'snapshot', 'list', $name)->@*) {
        my (undef, $snap) = split(/\@/, $snapshot->{name}, 2);
        $info->{pve_snap($snap)} = { id => $snapshot->{guid}, timestamp => $snapshot->{created} };
    }
    return $info;
}

sub storage_can_replicate {
    my ($class, $scfg, $storeid, $format) = @_;
    return $format eq 'raw' ? 1 : 0;
}

# ---------------------------------------------------------------------------------
# Export and import (`pvesm export`/`import`, which offline migration and
# `storage_migrate` pipe from one node to the other). Two formats, the first the one
# pve-storage picks between two fewerbytes storages (it takes the first format both
# sides offer):
#
# - `fewerbytes`: the disk (and, when asked, its snapshots) as fewerbytes send
#   streams (docs/stream.md), run by the servers: each distinct block crosses once,
#   zeros as runs, each snapshot as an increment from the one before, and an export
#   from a snapshot both sides hold (`$base_snapshot`) carries only what changed.
# - `raw+size`: the disk's size as a little-endian u64, then its bytes, read and
#   written over NBD (`nbdcopy`): what other storage types export and import. The
#   plugin counts the bytes, so a stream cut short fails the import (and removes the
#   half-written disk) instead of leaving zeros.
#
# A `fewerbytes` export is a sequence of parts, one send stream each:
#
#   "fewerbytes-pve 2\n"
#   for each part: "part " JSON "\n", then the stream in chunks (a u32 big-endian
#       length, then that many bytes), a length of 0 ending it
#   "end\n"
#
# A part's JSON says what it becomes: {"snapshot": SNAP} a snapshot, {"snapshot":
# null} the disk itself; {"base": SNAP} (or null) the snapshot it is an increment
# from; {"legacy": 1} when SNAP is an older plugin's clone (received as such). A
# snapshot's stream carries its identity: the importer's `volume receive` makes the
# disk (or updates it in place, from its base snapshot) and the snapshot with the
# sender's identity, so replication finds the common snapshot on both sides by it.
# Version 1 (an older plugin's export) had clones only; it is still imported.

my $STREAM_CHUNK = 1024 * 1024;

# Our format's name. pve-storage's `pvesm export` and `pvesm import` take only the
# formats in $PVE::Storage::KNOWN_EXPORT_FORMATS (their `format` parameter is an enum
# of that array, checked when they run), so the plugin adds its own to it when
# pve-storage loads it.
my $STREAM_FORMAT = 'fewerbytes';
if (my $known = do { no warnings 'once'; $PVE::Storage::KNOWN_EXPORT_FORMATS }) {
    push @$known, $STREAM_FORMAT if !grep { $_ eq $STREAM_FORMAT } @$known;
}
my $CONTAINER_MAGIC = "fewerbytes-pve 2\n";
my $CONTAINER_MAGIC_CLONES = "fewerbytes-pve 1\n";

# Copy exactly $size bytes from $from to $to (file handles), dying with $what if the
# source ends early or holds more.
my sub copy_exactly {
    my ($from, $to, $size, $what) = @_;
    my $copied = 0;
    while (1) {
        my $n = sysread($from, my $chunk, $STREAM_CHUNK);
        die "$what: read failed: $!\n" if !defined($n);
        last if $n == 0;
        $copied += $n;
        die "$what: more than the $size bytes the stream's header announced\n"
            if $copied > $size;
        my $off = 0;
        while ($off < $n) {
            my $w = syswrite($to, $chunk, $n - $off, $off);
            die "$what: write failed: $!\n" if !defined($w);
            $off += $w;
        }
    }
    die "$what: the stream ended after $copied of $size bytes\n" if $copied != $size;
}

my sub write_all {
    my ($fh, $bytes, $what) = @_;
    my $off = 0;
    while ($off < length($bytes)) {
        my $w = syswrite($fh, $bytes, length($bytes) - $off, $off);
        die "$what: write failed: $!\n" if !defined($w);
        $off += $w;
    }
}

# Exactly $len bytes from $fh, or die naming $what.
my sub read_exactly {
    my ($fh, $len, $what) = @_;
    my $bytes = '';
    while (length($bytes) < $len) {
        my $n = sysread($fh, $bytes, $len - length($bytes), length($bytes));
        die "$what: read failed: $!\n" if !defined($n);
        die "$what: the stream ended early\n" if $n == 0;
    }
    return $bytes;
}

# One line (up to "\n", at most 4 KiB) from $fh, a byte at a time: what follows it
# is chunked stream bytes, which must stay unread.
my sub read_line {
    my ($fh, $what) = @_;
    my $line = '';
    while ($line !~ /\n\z/) {
        die "$what: the stream is damaged (a header line past 4 KiB)\n" if length($line) > 4096;
        $line .= read_exactly($fh, 1, $what);
    }
    return $line;
}

# `fewerbytes ARGS` as the plugin's other commands run it, for a pipe.
my sub fewerbytes_command {
    my ($scfg, @args) = @_;
    die "storage has no fewerbytes-pool\n" if !$scfg->{'fewerbytes-pool'};
    return (
        $FEWERBYTES,
        '--pool', $scfg->{'fewerbytes-pool'},
        '--control-socket', control_socket($scfg),
        '--require-server',
        @args,
    );
}

# The parts an export of $volname sends, in order: { snap (undef: the disk), base
# (undef: a full stream), legacy } each, with the pool names to send.
my sub export_parts {
    my ($scfg, $storeid, $volname, $snapshot, $base_snapshot, $with_snapshots) = @_;
    my $name = pool_name($volname);
    my $volumes = pool_volumes($scfg);
    die "volume '$storeid:$volname' does not exist\n" if !$volumes->{$name};
    my @snaps = snapshot_list($scfg, $name, $volumes);
    my %by_name = map { $_->{snap} => $_ } @snaps;
    for my $snap (grep { defined } $snapshot, $base_snapshot) {
        die "snapshot '$snap' of '$storeid:$volname' does not exist\n" if !$by_name{$snap};
    }
    my @wanted;
    if ($with_snapshots) {
        # Every snapshot after the base (all of them without one), up to $snapshot
        # when the export is of that snapshot's moment.
        my $past_base = !defined($base_snapshot);
        for my $snap (@snaps) {
            if (!$past_base) {
                $past_base = $snap->{snap} eq $base_snapshot;
                next;
            }
            push @wanted, $snap;
            last if defined($snapshot) && $snap->{snap} eq $snapshot;
        }
        die "snapshot '$snapshot' of '$storeid:$volname' is not newer than the base"
            . " '$base_snapshot'\n"
            if defined($snapshot) && !grep { $_->{snap} eq $snapshot } @wanted;
    } elsif (defined($snapshot)) {
        @wanted = ($by_name{$snapshot});
    }
    my @parts;
    my $base = defined($base_snapshot) ? $by_name{$base_snapshot} : undef;
    for my $snap (@wanted) {
        push @parts, { snap => $snap, base => $base };
        $base = $snap;
    }
    # The disk itself, unless the export is of a snapshot's moment.
    push @parts, { snap => undef, base => $base } if !defined($snapshot);
    return @parts;
}

my sub stream_export {
    my ($scfg, $storeid, $fh, $volname, $snapshot, $base_snapshot, $with_snapshots) = @_;
    my $what = "export of '$storeid:$volname'";
    my @parts = export_parts($scfg, $storeid, $volname, $snapshot, $base_snapshot,
        $with_snapshots);
    write_all($fh, $CONTAINER_MAGIC, $what);
    for my $part (@parts) {
        my ($snap, $base) = ($part->{snap}, $part->{base});
        my @args = ('volume', 'send', $snap ? $snap->{pool_name} : pool_name($volname));
        push @args, '--from', $base->{pool_name} if $base;
        my $head = {
            snapshot => $snap ? $snap->{snap} : undef,
            base => $base ? $base->{snap} : undef,
            ($snap && $snap->{legacy} ? (legacy => 1) : ()),
        };
        write_all($fh, 'part ' . encode_json($head) . "\n", $what);
        open(my $send, '-|', fewerbytes_command($scfg, @args))
            or die "$what: cannot run fewerbytes: $!\n";
        while (1) {
            my $n = sysread($send, my $chunk, $STREAM_CHUNK);
            die "$what: read failed: $!\n" if !defined($n);
            last if $n == 0;
            write_all($fh, pack('N', $n) . $chunk, $what);
        }
        close($send) or die "$what: `fewerbytes @args` failed (exit " . ($? >> 8) . ")\n";
        write_all($fh, pack('N', 0), $what);
    }
    write_all($fh, "end\n", $what);
    return undef;
}

# Receive one part's chunks from $fh with `volume receive @args`; a failure abandons
# the partial volume (into $into).
my sub receive_part {
    my ($scfg, $fh, $into, $what, @options) = @_;
    my @args = ('volume', 'receive', $into, @options);
    open(my $receive, '|-', fewerbytes_command($scfg, @args))
        or die "$what: cannot run fewerbytes: $!\n";
    my $ok = eval {
        while (1) {
            my $len = unpack('N', read_exactly($fh, 4, $what));
            last if $len == 0;
            die "$what: the stream is damaged (a chunk of $len bytes)\n"
                if $len > $STREAM_CHUNK;
            write_all($receive, read_exactly($fh, $len, $what), $what);
        }
        1;
    };
    my $err = $@;
    close($receive);
    my $status = $?;
    return if $ok && $status == 0;
    # A migration that failed is run again from its start: nothing is kept to resume.
    eval { fewerbytes($scfg, 'volume', 'receive', $into, '--abandon') };
    die $err if !$ok;
    die "$what: `fewerbytes @args` failed (exit " . ($status >> 8) . "); its error is above\n";
}

my sub stream_import {
    my ($class, $scfg, $storeid, $fh, $volname, $base_snapshot, $allow_rename) = @_;
    my (undef, undef, $vmid) = $class->parse_volname($volname);
    my $volumes = pool_volumes($scfg);
    my $target = $volname;
    if (defined($base_snapshot)) {
        # An increment onto the disk this storage holds (replication): its base
        # snapshot must be here.
        die "cannot import an increment into '$storeid:$volname': its base snapshot"
            . " '$base_snapshot' is not here\n"
            if !$volumes->{pool_name($volname)} || !find_snapshot($scfg, $volname, $base_snapshot);
    } elsif ($volumes->{pool_name($volname)}) {
        die "volume '$storeid:$volname' already exists\n" if !$allow_rename;
        warn "volume '$storeid:$volname' already exists - importing with a different name\n";
        $target = free_disk_name($scfg, $storeid, $vmid, $volumes);
    }
    my $disk = pool_name($target);
    my $existed = $volumes->{$disk} ? 1 : 0;
    my $what = "import into '$storeid:$target'";
    my $magic = read_exactly($fh, length($CONTAINER_MAGIC), $what);
    die "$what: not a '$STREAM_FORMAT' export\n"
        if $magic ne $CONTAINER_MAGIC && $magic ne $CONTAINER_MAGIC_CLONES;
    my $clones_only = $magic eq $CONTAINER_MAGIC_CLONES;
    # What this import made, undone if it fails: snapshots, clones, the disk.
    my @made;
    # Whether the disk holds what the last part carried (else: an older plugin's
    # clone was the last, and the disk takes its content at the end).
    my $disk_current = 0;
    eval {
        while (1) {
            my $line = read_line($fh, $what);
            last if $line eq "end\n";
            die "$what: the stream is damaged (a part expected)\n"
                if $line !~ m/^part (\{.*\})\n\z/;
            my $part = decode_json($1);
            my ($snap, $base) = ($part->{snapshot}, $part->{base});
            for my $name (grep { defined } $snap, $base) {
                die "$what: the stream names snapshot '$name', not a Proxmox snapshot name\n"
                    if $name !~ m/^[A-Za-z0-9_\-]{1,40}$/;
            }
            my $legacy = defined($snap) && ($clones_only || $part->{legacy});
            # The base as this pool names it: its snapshot, or an older clone.
            my @from;
            if (defined($base)) {
                my $found = find_snapshot($scfg, $target, $base)
                    // die "$what: the base snapshot '$base' is not here\n";
                @from = ('--from', $found->{pool_name});
            }
            my $disk_exists = pool_volumes($scfg)->{$disk} ? 1 : 0;
            if ($legacy) {
                my $into = pool_name($target, $snap, 1);
                receive_part($scfg, $fh, $into, $what, @from);
                push @made, ['volume', 'delete', $into];
                $disk_current = 0;
                next;
            }
            die "$what: the stream carries the disk, which exists here\n"
                if !defined($snap) && !defined($base) && $disk_exists;
            # Onto the disk that exists (from one of its snapshots: updated in place,
            # as a replica is; written since that snapshot only by a failed run of
            # this import, whose writes --force discards), or a new disk.
            receive_part($scfg, $fh, $disk, $what, @from, ($disk_exists ? ('--force') : ()));
            push @made, ['volume', 'delete', $disk] if !$disk_exists;
            push @made, ['volume', 'snapshot', 'delete', $disk, pool_snap($snap)] if defined($snap);
            $disk_current = 1;
        }
        # An export of a snapshot's moment ends with that snapshot: the disk takes
        # its content. A snapshot of the pool made it so already; an older plugin's
        # clone is rolled back to (the disk exists: refused while a VM has it open) or
        # cloned (a new disk).
        if (!$disk_current) {
            my $last = $made[-1] // die "$what: the stream carries nothing\n";
            if (pool_volumes($scfg)->{$disk}) {
                fewerbytes($scfg, 'volume', 'rollback', $disk, $last->[2]);
            } else {
                fewerbytes($scfg, 'volume', 'clone', $last->[2], $disk);
                push @made, ['volume', 'delete', $disk];
            }
        }
        1;
    } or do {
        my $err = $@;
        for my $undo (reverse @made) {
            # The disk this import made goes; one that existed stays.
            next if $existed && $undo->[1] eq 'delete' && $undo->[2] eq $disk;
            eval { fewerbytes($scfg, @$undo) };
            warn $@ if $@;
        }
        die $err;
    };
    return "$storeid:$target";
}

my sub raw_size_only {
    my ($format, $base_snapshot, $with_snapshots) = @_;
    die "volume format '$format' is not available for a fewerbytes storage"
        . " ($STREAM_FORMAT, or raw+size without snapshots or a base)\n"
        if $format ne 'raw+size' || $with_snapshots || defined($base_snapshot);
}

# Snapshots and increments travel only in our own format; a plain disk in either.
sub volume_export_formats {
    my ($class, $scfg, $storeid, $volname, $snapshot, $base_snapshot, $with_snapshots) = @_;
    return ($STREAM_FORMAT) if $with_snapshots || defined($base_snapshot);
    return ($STREAM_FORMAT, 'raw+size');
}

sub volume_import_formats {
    my ($class, $scfg, $storeid, $volname, $snapshot, $base_snapshot, $with_snapshots) = @_;
    return ($STREAM_FORMAT) if $with_snapshots || defined($base_snapshot);
    return ($STREAM_FORMAT, 'raw+size');
}

sub volume_export {
    my ($class, $scfg, $storeid, $fh, $volname, $format, $snapshot, $base_snapshot,
        $with_snapshots) = @_;
    return stream_export($scfg, $storeid, $fh, $volname, $snapshot, $base_snapshot,
        $with_snapshots)
        if $format eq $STREAM_FORMAT;
    raw_size_only($format, $base_snapshot, $with_snapshots);
    my $size;
    if (defined($snapshot)) {
        my $found = find_snapshot($scfg, $volname, $snapshot)
            // die "snapshot '$snapshot' of '$storeid:$volname' does not exist\n";
        ($size) = map { $_->{size_bytes} }
            grep { $_->{name} eq $found->{pool_name} }
            ($found->{legacy} ? fewerbytes_json($scfg, 'volume', 'list')
                : fewerbytes_json($scfg, 'volume', 'snapshot', 'list', pool_name($volname)))->@*;
    } else {
        $size = fewerbytes_json($scfg, 'volume', 'info', pool_name($volname))->{size_bytes};
    }
    my $header = pack('Q<', $size);
    syswrite($fh, $header, 8) == 8 or die "export of '$storeid:$volname': write failed: $!\n";
    my $uri = scalar($class->path($scfg, $volname, $storeid, $snapshot));
    open(my $nbd, '-|', 'nbdcopy', '--', $uri, '-')
        or die "export of '$storeid:$volname': cannot run nbdcopy: $!\n";
    copy_exactly($nbd, $fh, $size, "export of '$storeid:$volname'");
    close($nbd) or die "export of '$storeid:$volname': nbdcopy failed (exit " . ($? >> 8) . ")\n";
    return undef;
}

sub volume_import {
    my ($class, $scfg, $storeid, $fh, $volname, $format, $snapshot, $base_snapshot,
        $with_snapshots, $allow_rename) = @_;
    my ($vtype, $name, $vmid) = $class->parse_volname($volname);
    die "cannot import '$volname': a fewerbytes storage holds disk images only\n"
        if $vtype ne 'images';
    return stream_import($class, $scfg, $storeid, $fh, $volname, $base_snapshot,
        $allow_rename)
        if $format eq $STREAM_FORMAT;
    raw_size_only($format, $base_snapshot, $with_snapshots);
    if (pool_volumes($scfg)->{pool_name($volname)}) {
        die "volume '$storeid:$volname' already exists\n" if !$allow_rename;
        warn "volume '$storeid:$volname' already exists - importing with a different name\n";
        $name = undef;
    }
    my $read = sysread($fh, my $header, 8);
    die "import into '$storeid': no size found in the stream's header\n"
        if !defined($read) || $read != 8;
    my $size = unpack('Q<', $header);
    die "import into '$storeid': the stream announces a disk of 0 bytes\n" if !$size;
    my $allocated = $class->alloc_image($storeid, $scfg, $vmid, 'raw', $name, ceil($size / 1024));
    eval {
        my $uri = scalar($class->path($scfg, $allocated, $storeid));
        open(my $nbd, '|-', 'nbdcopy', '--', '-', $uri)
            or die "import of '$storeid:$allocated': cannot run nbdcopy: $!\n";
        copy_exactly($fh, $nbd, $size, "import of '$storeid:$allocated'");
        close($nbd)
            or die "import of '$storeid:$allocated': nbdcopy failed (exit " . ($? >> 8) . ")\n";
    };
    if (my $err = $@) {
        eval { $class->free_image($storeid, $scfg, $allocated, 0, 'raw') };
        warn $@ if $@;
        die $err;
    }
    return "$storeid:$allocated";
}

# The clone is taken with the server's write gate held: the image of every write
# answered before it, as after a power cut. Ask the guest agent to freeze file systems.
sub volume_snapshot_needs_fsfreeze {
    return 1;
}

sub volume_qemu_snapshot_method {
    my ($class, $storeid, $scfg, $volname) = @_;
    return 'storage';
}

sub volume_has_feature {
    my ($class, $scfg, $feature, $storeid, $volname, $snapname, $running, $opts) = @_;

    my $features = {
        snapshot => { current => 1, snap => 1 },
        clone => { base => 1 },
        template => { current => 1 },
        copy => { base => 1, current => 1 },
        # A new volume reads as zeros: copies may skip zero blocks.
        sparseinit => { base => 1, current => 1 },
        rename => { current => 1 },
        # Snapshots keep their identity across pools (volume_snapshot_info), and an
        # increment from a common one updates the replica in place (stream_import).
        replicate => { base => 1, current => 1 },
    };
    my (undef, undef, undef, undef, undef, $is_base) = $class->parse_volname($volname);
    my $key = $snapname ? 'snap' : $is_base ? 'base' : 'current';
    return $features->{$feature}->{$key} ? 1 : undef;
}

1;
